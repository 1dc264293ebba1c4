#!/usr/bin/env bash
# On the GPU machine: install the wheel built on the CPU machine (in .gpu/), run
# the GPU tests, then the benchmark, in one go. JSON and plots go to $OUT, the text
# logs into $OUT/logs.tgz.
#   CPU machine:  CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST=9.0a pip wheel --no-build-isolation --no-deps -w .gpu/ .
#                 bash /path/to/shared/tools/pack_cueq.sh .gpu/cueq     (optional: cuEquivariance for the benchmark)
#   GPU machine:  bash ci/gpu_check.sh [pytest args...]
# Env: BENCH=default|quick|model|none (default: default), BENCH_ARGS (e.g. --profile),
#      SANITIZE=1 also runs compute-sanitizer, TESTS=0 skips the tests, JOBS=n runs them in n
#      pytest processes (pytest-xdist, where installed; default 8, 1 for one process) with
#      OMP_NUM_THREADS=2 each (with torch's default threads, eight processes on 16 cores had not
#      finished in 300 s what takes 122 s so: benchmarks/NOTES.md, "The GPU suite's wall time"),
#      SMALL=1 runs benchmarks/small.py (small problems and the dispatcher's crossover), SMALL_ARGS
#      passes it arguments (e.g. --no-sweep).
#      NCU=1 profiles the two 16-bit stages at (1, 1024, 128, 128) bf16 under ncu: their times and
#      instruction counts, and per-instruction counts and stall samples summarized by
#      ci/sass_hotspots.py (the stages' resident forms: one block of 8 warps per SM).
set -uo pipefail
OUT=${OUT:-/tmp/trimul-out}
mkdir -p "$OUT"
R=$PWD
SITE=/tmp/trimul-site
rm -rf "$SITE"
python3 -m pip install -q --no-deps --no-index --target "$SITE" .gpu/trimul-*.whl || exit 1
PYPATH=$SITE
if [ -f .gpu/cueq/cueq.tar.xz ]; then
  python3 -c "import tarfile; tarfile.open('.gpu/cueq/cueq.tar.xz').extractall('/tmp/cueq')"
  python3 -m pip install -q --no-index --no-deps --target /tmp/cueq .gpu/cueq/platformdirs-*.whl
  PYPATH=$PYPATH:/tmp/cueq
fi
export PYTHONPATH=$PYPATH PYTHONUNBUFFERED=1
cd /tmp || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, trimul; print('trimul from', trimul.__file__, 'kernels:', trimul.HAS_CUDA_KERNELS, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m trimul.info --shape 1 1024 128 128 2>&1 | tee -a "$OUT/gpu.txt"
python3 -m trimul.demo 2>&1 | tee "$OUT/demo.txt"
status=0
if [ "${TESTS:-1}" = 1 ]; then
  workers=() threads=
  if [ "${JOBS:-8}" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${JOBS:-8}") threads=${OMP_NUM_THREADS:-2}
  fi
  env ${threads:+OMP_NUM_THREADS=$threads} python3 -m pytest -q -rs ${workers[@]+"${workers[@]}"} "$R/tests" "$@" 2>&1 | tee "$OUT/tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  # a process per tool and path, every kernel instrumented (cuBLAS's too): racecheck with a
  # --kernel-name filter (compute-sanitizer 2025.3.1) stopped at cuBLAS's calls ("failed to handle a
  # hardware exception") where the unfiltered run passes (benchmarks/NOTES.md, "Backward"); racecheck
  # of "backward" takes ~4.5 minutes on an H100
  for tool in memcheck racecheck; do
    for path in fused_small tiled backward; do
      log="$OUT/sanitize_${tool}_$path.log"
      compute-sanitizer --tool $tool --print-limit 0 python3 "$R/ci/sanitize_case.py" $path > "$log" 2>&1
      # every report counted; those outside cuBLAS's nvjet kernels (its split-K ones report hazards) shown
      echo "$tool $path: $(grep -E 'SUMMARY|cases done' "$log" | tr '\n' ' ')"
      grep -E "^========= [A-Z]" "$log" | grep -v -E "nvjet|COMPUTE-SANITIZER|SUMMARY" | head -10
    done
  done
fi
if [ "${SMALL:-0}" = 1 ]; then
  python3 "$R/benchmarks/small.py" --json "$OUT/small.json" ${SMALL_ARGS:-} 2>&1 | tee "$OUT/small.log"
fi
if [ "${NCU:-0}" = 1 ]; then
  sms=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)")
  for stage in ln_proj_gate ln_out_proj_gate; do
    ncu --clock-control none --kernel-name "regex:^.*${stage}_(mma|resident)" --launch-count 1 --section SpeedOfLight \
      --section SourceCounters --section WarpStateStats --metrics smsp__inst_executed.sum -o "/tmp/$stage" -f \
      python3 "$R/ci/profile_case.py" 1 1024 128 128 bfloat16 default tiled > /dev/null 2>&1
    ncu -i "/tmp/$stage.ncu-rep" --page details 2>&1 | grep -E "_kernel|Duration|inst_executed" | tee "$OUT/ncu_$stage.txt"
    ncu -i "/tmp/$stage.ncu-rep" --page source --csv --print-source sass > "/tmp/$stage.csv" 2>&1
    # the chunked kernels: 1024 rows x 8 column tiles of 128 positions, 8 warps each; the resident
    # ones: one block of 8 warps per SM
    warps=$((1024 * 8 * 8))
    grep -q "resident" "$OUT/ncu_$stage.txt" && warps=$((${sms:-132} * 8))
    python3 "$R/ci/sass_hotspots.py" "/tmp/$stage.csv" --warps $warps | tee -a "$OUT/ncu_$stage.txt"
  done
fi
if [ "${BENCH:-default}" != none ]; then
  python3 "$R/benchmarks/bench.py" --shapes "${BENCH:-default}" --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
# the text logs travel as one archive (few files come back from the GPU machine)
(cd "$OUT" && shopt -s nullglob && logs=(./*.log ./*.txt) && [ ${#logs[@]} -gt 0 ] && tar czf logs.tgz "${logs[@]}" && rm -f "${logs[@]}")
exit "$status"

// Forced into the C++ sources by setup.py (-include): symbol versions old enough
// for glibc 2.28, the floor of the manylinux_2_28 wheel tag, whatever glibc the
// build machine has.
#pragma once

#if defined(__linux__) && defined(__x86_64__)
// dlsym (used by torch's stable-ABI headers to find newer shims at run time)
// and dlopen (csrc/blas_lt.cpp) moved from libdl into libc in glibc 2.34 under
// a new version; GLIBC_2.2.5 is the version every glibc since then provides.
__asm__(".symver dlsym, dlsym@GLIBC_2.2.5");
__asm__(".symver dlopen, dlopen@GLIBC_2.2.5");
#endif

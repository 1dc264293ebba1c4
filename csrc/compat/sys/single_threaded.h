// Stands in for glibc's <sys/single_threaded.h> (glibc 2.32 and newer), found
// first through setup.py's include path. libstdc++'s headers read
// __libc_single_threaded when that header exists, which would tie the binary to
// glibc 2.32. Answering "not known to be single-threaded" keeps libstdc++'s
// reference counts atomic, as they are on older glibc.
#pragma once

static const char trimul_libc_single_threaded = 0;
#define __libc_single_threaded trimul_libc_single_threaded

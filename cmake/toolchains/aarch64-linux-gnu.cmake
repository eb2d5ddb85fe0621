# Cross-compiling kvcache for aarch64 Linux with Debian's g++-aarch64-linux-gnu; test binaries run
# under qemu-aarch64 (package qemu-user) through CMAKE_CROSSCOMPILING_EMULATOR, so ctest works
# unchanged. Used by scripts/cross_aarch64.sh, which also provides GoogleTest and {fmt} for it.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(KVCACHE_CROSS_TRIPLE aarch64-linux-gnu)
set(KVCACHE_CROSS_SYSROOT /usr/${KVCACHE_CROSS_TRIPLE})
set(CMAKE_C_COMPILER ${KVCACHE_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${KVCACHE_CROSS_TRIPLE}-g++)

# Libraries, headers and packages only from the target's tree (plus any extra roots the caller
# appends, e.g. the prefix the script installs an aarch64 GoogleTest into); programs from the host.
list(APPEND CMAKE_FIND_ROOT_PATH ${KVCACHE_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

find_program(KVCACHE_QEMU_AARCH64 qemu-aarch64)
if(KVCACHE_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${KVCACHE_QEMU_AARCH64} -L ${KVCACHE_CROSS_SYSROOT})
endif()

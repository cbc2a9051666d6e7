# Sourced by the GPU recipes. A fresh GPU machine compiles every Triton kernel of a run again: session 21's first
# `bench/profile_decode.py` on a fresh machine had not reached its batch-1 result after 125 s, where a warm machine
# finished the whole run in 30. So the compiled kernels (and autotuning results) travel between calls: a call starts
# from `.gpu-cache/triton-cache.tar.xz` when the caller carried ".gpu-cache", and leaves its cache, packed, in its
# output folder, for the caller to put back into .gpu-cache/ (ignored) before the next call.
#
# Only what loading a kernel reads is packed: each kernel's metadata and group JSON and its binary (.cubin), and the
# autotuning JSON. Triton's cache lookup takes a group whose IR files (.ttir, .ttgir, .llir, .ptx, .source) are
# missing, and a kernel launches from its binary. Session 22's full run packed to 50 MiB with gzip and everything,
# over the 16 MiB a call returns; on this CPU's sm_90 compiles the binaries and JSON are a third of the gzip and xz
# packs them another 2.6x smaller.
restore_triton_cache() {  # restore_triton_cache [DIR]: unpack DIR/triton-cache.tar.xz (default .gpu-cache) if there
    local dir=${1:-.gpu-cache}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -f "$dir/triton-cache.tar.xz" ]; then
        tar xJf "$dir/triton-cache.tar.xz" -C "$TRITON_CACHE_DIR" && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries restored"
    fi
}
save_triton_cache() {  # save_triton_cache OUT: pack the loadable part of the cache into OUT/triton-cache.tar.xz
    [ -n "${TRITON_CACHE_DIR:-}" ] && [ -d "$TRITON_CACHE_DIR" ] || return 0
    command -v xz > /dev/null || { echo "triton cache: no xz here; not saved"; return 0; }
    local list size
    list=$(mktemp)
    (cd "$TRITON_CACHE_DIR" && find . -type f \( -name "*.json" -o -name "*.cubin" \)) > "$list"
    tar cf - -C "$TRITON_CACHE_DIR" -T "$list" | xz -T0 -6 > "$1/triton-cache.tar.xz" \
        || { rm -f "$list" "$1/triton-cache.tar.xz"; return 0; }
    rm -f "$list"
    size=$(stat -c %s "$1/triton-cache.tar.xz")
    if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
        echo "triton cache: $((size >> 20)) MiB packed, too large to come back; not saved"
        rm -f "$1/triton-cache.tar.xz"
    else
        echo "triton cache: $((size >> 10)) KiB packed into $1/triton-cache.tar.xz"
    fi
}

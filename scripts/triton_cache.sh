# Sourced by the GPU recipes. A fresh GPU machine compiles every Triton kernel of a run again: session 21's first
# `bench/profile_decode.py` on a fresh machine had not reached its batch-1 result after 125 s, where a warm machine
# finished the whole run in 30. So the compiled kernels (and autotuning results) travel between calls: a call starts
# from `.gpu-cache/triton-cache.tar.gz` when the caller carried ".gpu-cache", and leaves its cache, packed, in its
# output folder, for the caller to put back into .gpu-cache/ (ignored) before the next call.
restore_triton_cache() {  # restore_triton_cache [DIR]: unpack DIR/triton-cache.tar.gz (default .gpu-cache) if there
    local dir=${1:-.gpu-cache}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -f "$dir/triton-cache.tar.gz" ]; then
        tar xzf "$dir/triton-cache.tar.gz" -C "$TRITON_CACHE_DIR" && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries restored"
    fi
}
save_triton_cache() {  # save_triton_cache OUT: pack the cache into OUT/triton-cache.tar.gz (16 MiB at most come back)
    [ -n "${TRITON_CACHE_DIR:-}" ] && [ -d "$TRITON_CACHE_DIR" ] || return 0
    tar czf "$1/triton-cache.tar.gz" -C "$TRITON_CACHE_DIR" . || return 0
    local size
    size=$(stat -c %s "$1/triton-cache.tar.gz")
    if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
        echo "triton cache: $((size >> 20)) MiB packed, too large to come back; not saved"
        rm -f "$1/triton-cache.tar.gz"
    else
        echo "triton cache: $((size >> 10)) KiB packed into $1/triton-cache.tar.gz"
    fi
}

# Sourced by the GPU recipes (gpu_check.sh, bench_tp.sh, train_default_model.sh). The GPU machine reaches no registry,
# so what its image lacks travels as wheels: those in .whl/ (carry ".whl" in the call) and in any folder given are
# installed into /tmp/site (or $CARRIED_SITE: two recipes run side by side on two GPUs install apart), which goes on
# PYTHONPATH ahead of the checkout.
install_carried_wheels() {
    local dir
    for dir in .whl "$@"; do
        if ls "$dir"/*.whl >/dev/null 2>&1; then
            "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "${CARRIED_SITE:-/tmp/site}" "$dir"/*.whl || return 1
        fi
    done
    export PYTHONPATH=${CARRIED_SITE:-/tmp/site}:$PWD
}

#!/bin/sh
# Container entrypoint: check the configuration in milliseconds, then exec the HTTP front (ours, `python -m front`,
# or the production hfendpoint when FRONT=hfendpoint) with `python -m handler` behind it.
# exec, so that the daemon gets the container's signals; on SIGTERM the daemon stops taking requests and
# sends the handler EOF, and the handler finishes those in flight (HFENDPOINT_DRAIN_TIMEOUT) and exits.
set -eu

usage() {
	cat <<'EOF'
Usage: entrypoint.sh [HANDLER_ARGS...]

Starts the HTTP front on HOST:PORT (OpenAI API: /v1/chat/completions, /v1/embeddings;
health: /health) and the handler (`python -m handler HANDLER_ARGS...`) behind it.

The default front is ours (`python -m front`): it forwards every request field, answers /health 503 until
the handler has loaded its model (and whenever the handler stops answering), checks HFENDPOINT_API_KEY and
serves /metrics. FRONT=hfendpoint runs the production daemon instead (an image built with
--build-arg WITH_HFENDPOINT=yes): v0.3.0 forwards only `messages` and `stream` (temperature, max_tokens,
tools, response_format, logprobs, n, seed, stop... are dropped), refuses list `content`, has no key, no
/metrics, and answers /health 200 as soon as it listens, while the model may still be loading.

Variables read here:
  PORT                       port to listen on (default 80)
  HOST                       address to bind (default 0.0.0.0)
  PYTHON                     the Python that runs the handler (default python3)
  FRONT                      `ours` (default) or `hfendpoint`
  FRONT_PYTHON               the Python that runs our front (default PYTHON; the image's copy may
                             bind port 80 as a non-root user)
  HFENDPOINT_BIN             the hfendpoint binary when FRONT=hfendpoint (default hfendpoint from PATH)
  HFENDPOINT_API_KEY         our front only: require `Authorization: Bearer KEY` (hfendpoint
                             v0.3.0 has no authentication of its own)
  HFENDPOINT_OPEN_METRICS    our front only: true serves /metrics without the key (default false)
  HFENDPOINT_REPOSITORY_DIR  where a mounted model is looked for (default /repository; Inference
                             Endpoints mount the model there); it wins over MODEL_ID
  HFENDPOINT_CACHE_VOLUME    a writable volume that outlives the container (default /data): when it is
                             mounted and TRITON_CACHE_DIR is unset, Triton keeps its compiled kernels
                             in VOLUME/nanovllm-endpoint/triton, so the next start skips compiling them
  TRITON_CACHE_DIR           where Triton keeps compiled kernels (Triton's default: ~/.triton/cache)
  MODEL_ID                   hub id (org/name) or local path (directory with config.json, or a .gguf
                             file); a path that does not exist is an error; unset: the handler's default

Passed on to the handler (inherited environment; defaults in the README):
  HF_TOKEN, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_HUB_ETAG_TIMEOUT, HF_ENDPOINT
  HFENDPOINT_DEVICE, HFENDPOINT_DTYPE, HFENDPOINT_MAX_MODEL_LEN, HFENDPOINT_GPU_MEMORY_UTILIZATION,
  HFENDPOINT_ENFORCE_EAGER, HFENDPOINT_MAX_BATCHED_TOKENS, HFENDPOINT_MAX_SEQS,
  HFENDPOINT_TENSOR_PARALLEL_SIZE, HFENDPOINT_KV_BLOCK_SIZE, HFENDPOINT_CPU_KV_CACHE_GB,
  HFENDPOINT_NUM_KV_BLOCKS, HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS, HFENDPOINT_MODEL_NAME,
  HFENDPOINT_CACHE_DIR (converted config and tokenizer of .gguf models), HFENDPOINT_OVERLAP_STEPS,
  HFENDPOINT_FP8_GEMM, HFENDPOINT_KV_CACHE_DTYPE, HFENDPOINT_GPU_FEATURES, HFENDPOINT_SPECULATIVE,
  HFENDPOINT_DATA_PARALLEL_SIZE (engines, each on its own HFENDPOINT_TENSOR_PARALLEL_SIZE GPUs; default 1),
  HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE (run chat templates sent with requests; default false),
  HFENDPOINT_DRAIN_TIMEOUT (seconds the requests in flight get after SIGTERM; default 30),
  HFENDPOINT_IMAGE_MAX_BYTES, HFENDPOINT_IMAGE_MAX_PIXELS, HFENDPOINT_IMAGE_FETCH_TIMEOUT,
  HFENDPOINT_MAX_IMAGES_PER_REQUEST, HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS (images in chat),
  HFENDPOINT_AUTO_TRUNCATE (embed long inputs' last tokens instead of refusing them; default false),
  what one request may size (a 400 names the field past each): HFENDPOINT_MAX_N, HFENDPOINT_MAX_TOP_LOGPROBS,
  HFENDPOINT_MAX_LOGIT_BIAS_ENTRIES, HFENDPOINT_MAX_TOOLS, HFENDPOINT_MAX_STOP_STRINGS, HFENDPOINT_MAX_STOP_CHARS,
  HFENDPOINT_MAX_SCHEMA_BYTES, HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT, HFENDPOINT_MAX_GRAMMAR_BYTES,
  HFENDPOINT_MAX_NESTING_DEPTH, HFENDPOINT_MAX_PROMPT_CHARS
EOF
}

die() {
	printf 'entrypoint: error: %s\n' "$*" >&2
	exit 1
}

log() {
	printf 'entrypoint: %s\n' "$*" >&2
}

check_port() {
	case $PORT in
	'' | *[!0-9]*) die "PORT=$PORT is not a port number; set PORT to an integer from 1 to 65535" ;;
	esac
	[ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || die "PORT=$PORT is out of range; set PORT to an integer from 1 to 65535"
}

# A MODEL_ID that names a path (absolute, relative with a leading dot, ~/..., or a .gguf file) must exist:
# a typo there would otherwise surface only after the daemon and the Python imports are up.
check_model() {
	if has_mounted_model "$REPOSITORY_DIR"; then
		log "serving the model mounted at $REPOSITORY_DIR"
		return
	fi
	if [ -z "${MODEL_ID:-}" ]; then
		log "MODEL_ID is not set and nothing is mounted at $REPOSITORY_DIR: the handler serves its default model"
		return
	fi
	case $MODEL_ID in
	\~/*) model_path=$HOME/${MODEL_ID#\~/} ;;
	/* | .* | *.gguf) model_path=$MODEL_ID ;;
	*) model_path= ;;
	esac
	if [ -n "$model_path" ] && [ ! -e "$model_path" ]; then
		die "MODEL_ID=$MODEL_ID: no such file or directory; set MODEL_ID to an existing model directory or .gguf file, or to a hub id (org/name)"
	fi
	log "serving MODEL_ID=$MODEL_ID"
}

# Compiled kernels on a volume survive a scale-to-zero: the next replica starts without compiling them.
use_cache_volume() {
	[ -n "${TRITON_CACHE_DIR:-}" ] && return
	volume=${HFENDPOINT_CACHE_VOLUME:-/data}
	[ -d "$volume" ] && [ -w "$volume" ] || return 0
	if mkdir -p "$volume/nanovllm-endpoint/triton" 2>/dev/null; then
		export TRITON_CACHE_DIR="$volume/nanovllm-endpoint/triton"
		log "Triton's kernel cache is on the volume: $TRITON_CACHE_DIR"
	fi
}

has_mounted_model() {
	[ -f "$1/config.json" ] && return 0
	for file in "$1"/*.gguf; do
		[ -f "$file" ] && return 0
	done
	return 1
}

# Ports below net.ipv4.ip_unprivileged_port_start need CAP_NET_BIND_SERVICE. The image gives it to the
# hfendpoint binary as a file capability, which the kernel ignores under no_new_privs (Docker's
# --security-opt no-new-privileges, Kubernetes' allowPrivilegeEscalation: false): say so instead of
# letting the daemon fail later with a bare "permission denied".
check_port_bindable() {
	has_file_capability=$1
	[ "$(id -u)" -eq 0 ] && return
	first_free_port=$(cat /proc/sys/net/ipv4/ip_unprivileged_port_start 2>/dev/null || echo 1024)
	[ "$PORT" -ge "$first_free_port" ] && return
	if [ "$has_file_capability" = yes ] && ! grep -qs '^NoNewPrivs:[[:space:]]*1' /proc/self/status; then
		return
	fi
	die "user $(id -un) cannot bind port $PORT (ports below $first_free_port are privileged here); set PORT to $first_free_port or above, or run the container with --sysctl net.ipv4.ip_unprivileged_port_start=0"
}

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
	usage
	exit 0
fi

PORT=${PORT:-80}
HOST=${HOST:-0.0.0.0}
PYTHON=${PYTHON:-python3}
REPOSITORY_DIR=${HFENDPOINT_REPOSITORY_DIR:-/repository}

FRONT=${FRONT:-ours}
FRONT_PYTHON=${FRONT_PYTHON:-$PYTHON}
case $FRONT in
ours)
	# The image's FRONT_PYTHON is a copy of the interpreter with the capability to bind low ports.
	if [ "$FRONT_PYTHON" != "$PYTHON" ]; then front_has_capability=yes; else front_has_capability=no; fi
	;;
hfendpoint)
	daemon=${HFENDPOINT_BIN:-hfendpoint}
	front_has_capability=yes
	;;
*) die "FRONT=$FRONT is not a front; set FRONT to ours (the default) or hfendpoint" ;;
esac

check_port
check_port_bindable "$front_has_capability"
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON: command not found; set PYTHON to the interpreter that has nanovllm-endpoint installed"
if [ "$FRONT" = hfendpoint ]; then
	command -v "$daemon" >/dev/null 2>&1 || die "FRONT=hfendpoint but $daemon is not installed; build the image with --build-arg WITH_HFENDPOINT=yes, set HFENDPOINT_BIN, or unset FRONT to use our front"
else
	command -v "$FRONT_PYTHON" >/dev/null 2>&1 || die "FRONT_PYTHON=$FRONT_PYTHON: command not found; unset it to run our front on PYTHON"
fi
check_model
use_cache_volume

if [ "$FRONT" = hfendpoint ]; then
	log "starting $daemon on $HOST:$PORT: it forwards only messages and stream, and its /health answers 200 before the model has loaded"
	exec "$daemon" --host "$HOST" --port "$PORT" -- "$PYTHON" -m handler "$@"
fi
log "starting our front (python -m front) on $HOST:$PORT; /health answers 503 until the model has loaded"
exec "$FRONT_PYTHON" -m front --host "$HOST" --port "$PORT" -- "$PYTHON" -m handler "$@"

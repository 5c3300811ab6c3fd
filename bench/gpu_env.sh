# Sourced by bench/gpu_*.sh on the GPU machine (device tool): the packages its image lacks (wheels
# carried in .whl/, see README), the environment every run needs, $OUT for logs, the 1b model in $M.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/m1b
[ -f $M/config.json ] || python3 -m engines.make_model $M --preset 1b > "$OUT/make_model.log"

wait_ready() {  # wait_ready URL [TRIES]: until URL/readyz answers 200 (0.5 s apart)
  for _ in $(seq "${2:-240}"); do curl -sf "$1/readyz" >/dev/null && return 0; sleep 0.5; done
  echo "not ready: $1" >&2; return 1
}

all_ready() {  # all_ready CONFIG [TRIES]: until every engine and daemon of the supervisor is READY
  for _ in $(seq "${2:-240}"); do
    python3 -m supervisor.cli status -c "$1" --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin)
sys.exit(0 if all(x['state'] == 'READY' for x in d['engines'] + d['daemons']) else 1)" && return 0
    sleep 0.5
  done
  echo "not all READY: $1" >&2; return 1
}

since() { python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$1"; }  # seconds since an epoch time

memory() {  # memory CONFIG: GPU memory per device and per process, and the supervisor's view
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv
  python3 -m supervisor.cli status -c "$1"
}

start_serve() {  # start_serve CONFIG LOG: `understudy serve` in the background ($sup) until all is READY
  python3 -m supervisor.cli serve -c "$1" > "$2" 2>&1 &
  sup=$!
  wait_ready http://127.0.0.1:8000 && all_ready "$1" || { tail -40 "$2"; kill -9 $sup; exit 1; }
}

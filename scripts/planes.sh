# Sourced by benchmark scripts: private etcd and NATS servers on free loopback ports, data under
# $1, stopped by the caller's cleanup (their pids are appended to the `pids` array). Sets
# `planes` to the `--control … --events …` arguments that reach them.
# Needs etcd and nats-server on PATH (scripts/prereqs.sh installs them).
export PATH="$PATH:/usr/sbin"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 400); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }
start_planes() {
  local dir=$1 etcd_port etcd_peer nats_port
  etcd_port=$(free_port); etcd_peer=$(free_port); nats_port=$(free_port)
  etcd --name bench --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" --initial-cluster "bench=http://127.0.0.1:$etcd_peer" \
    >/dev/null 2>&1 &
  pids+=($!)
  nats-server -a 127.0.0.1 -p "$nats_port" -js -sd "$dir/nats" >/dev/null 2>&1 &
  pids+=($!)
  wait_port "$etcd_port"; wait_port "$nats_port"
  planes=(--control "etcd://127.0.0.1:$etcd_port" --events "nats://127.0.0.1:$nats_port")
}

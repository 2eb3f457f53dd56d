#!/usr/bin/env bash
# Trace a CRR loop through aioslirp and look at it in Jaeger.
#
#   1. start Jaeger all-in-one (OTLP/HTTP on 4318, UI on 16686), see README.md;
#   2. examples/jaeger/run.sh [ITERATIONS] [OTLP_URL]
#   3. open http://localhost:16686, service "aioslirp": one trace per guest TCP connection.
#
# Runs as root, or rootless where unprivileged user namespaces are allowed and /dev/net/tun
# is mode 0666. Everything stays on this machine: the echo server binds 127.0.0.1 and the
# guest reaches it through the gateway 10.0.2.2.
set -euo pipefail
cd "$(dirname "$0")/../.."

N="${1:-200}"
OTLP="${2:-${OTLP_URL:-http://127.0.0.1:4318}}"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import opentelemetry.exporter.otlp.proto.http' 2>/dev/null; then
  echo "needs the otlp extra: pip install -e '.[otlp]'" >&2
  exit 2
fi
if ! "$PY" - "$OTLP" <<'PYEOF'
import sys, urllib.parse, socket
u = urllib.parse.urlsplit(sys.argv[1])
try:
    socket.create_connection((u.hostname, u.port or 80), timeout=2).close()
except OSError as exc:
    sys.exit(f"nothing listens on {u.hostname}:{u.port} ({exc.strerror}): start Jaeger first (see README.md)")
PYEOF
then
  exit 1
fi

WORK="$(mktemp -d)"
TRACE="${TRACE_FILE:-$WORK/crr.jsonl}"

# A 1-byte echo server on host loopback (stopped on exit).
"$PY" - <<'PYEOF' > "$WORK/port" &
import socket, sys
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(256)
print(l.getsockname()[1], flush=True)
while True:
    c, _ = l.accept()
    with c:
        d = c.recv(1)
        if d:
            c.sendall(d)
        while c.recv(64):
            pass
PYEOF
ECHO_PID=$!
trap 'kill "$ECHO_PID" 2>/dev/null || true; rm -f "$WORK/port"' EXIT
for _ in $(seq 50); do [ -s "$WORK/port" ] && break; sleep 0.1; done
PORT="$(cat "$WORK/port")"

# The guest: one process, N connect / 1-byte request / 1-byte response / close.
OTEL_SERVICE_NAME="${OTEL_SERVICE_NAME:-aioslirp}" \
"$PY" -m aioslirp run --otlp-endpoint "$OTLP" --trace "$TRACE" --trace-level frames -- "$PY" -c '
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
lat = []
for _ in range(n):
    t = time.perf_counter_ns()
    s = socket.create_connection(("10.0.2.2", port)); s.sendall(b"x"); assert s.recv(1) == b"x"; s.close()
    lat.append(time.perf_counter_ns() - t)
lat.sort()
print(f"{n} CRR iterations, p50 {lat[n // 2] / 1000:.0f} us (traced)")
' "$PORT" "$N"

echo "spans sent to $OTLP; also kept in $TRACE:"
"$PY" -m aioslirp trace-report "$TRACE" --connections 1 | tail -n 4
echo "open http://localhost:16686 and pick the service 'aioslirp' (operation tcp.flow)"

#!/usr/bin/env bash
# Install edgerun as a system service, as docs/serving.md ("Running under systemd") describes:
#   a venv under PREFIX with edgerun installed from this checkout (not editable: the unit's
#   ProtectHome=yes hides home directories), with the [serve] extra and, where an NVIDIA GPU is
#   (a Jetson or nvidia-smi), the [gpu] extra (triton); the `edgerun` service account; /etc/edgerun
#   (serve.yaml from systemd/serve.yaml unless one exists, the device profiles); the units with
#   ExecStart naming the venv, checked by `systemd-analyze verify`; then enabled and started.
#
#   sudo scripts/install.sh [--prefix /opt/edgerun] [--torch SPEC|system] [--gpu auto|yes|no]
#                           [--root DIR] [--no-start]
#
# --torch: a pip requirement for PyTorch (default: torch>=2.4), or `system` to use the torch the
#   system Python already has (JetPack's, on a Jetson: the venv then sees system site-packages).
# --root DIR: write what goes under /etc and /var/lib into DIR instead (a test, or an image being
#   staged): no account, no systemctl. The venv still goes to PREFIX, as the unit names it.
set -euo pipefail

PREFIX=/opt/edgerun ROOT="" TORCH="torch>=2.4" GPU=auto START=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$(realpath -m "$2"); shift 2 ;;
    --root) ROOT=$(realpath -m "$2"); shift 2 ;;
    --torch) TORCH=$2; shift 2 ;;
    --gpu) GPU=$2; shift 2 ;;
    --no-start) START=0; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$GPU" in auto|yes|no) ;; *) echo "install.sh: error: --gpu must be auto, yes or no, got $GPU" >&2; exit 2 ;; esac
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || { echo "install.sh: error: run as root (or with --root DIR)" >&2; exit 2; }

SRC=$(cd "$(dirname "$0")/.." && pwd)
VENV=$PREFIX/venv
say() { echo "install.sh: $*"; }

# 1. the venv, from this checkout
if [ "$GPU" = auto ]; then
  if [ -e /etc/nv_tegra_release ] || command -v nvidia-smi >/dev/null 2>&1; then GPU=yes; else GPU=no; fi
fi
extras=serve
[ "$GPU" = yes ] && extras=serve,gpu
venv_flags=()
[ "$TORCH" = system ] && venv_flags=(--system-site-packages)
say "venv $VENV (extras: $extras; torch: $TORCH)"
python3 -m venv "${venv_flags[@]}" "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
[ "$TORCH" = system ] || "${pip[@]}" "$TORCH"
"${pip[@]}" "$SRC[$extras]"
"$VENV/bin/edgerun" --version

# 2. the service account (groups video and render reach a Jetson's GPU devices)
if [ -z "$ROOT" ] && ! id edgerun >/dev/null 2>&1; then
  groups=$(for g in video render; do getent group "$g" >/dev/null && printf '%s,' "$g"; done)
  useradd --system --home-dir /var/lib/edgerun --no-create-home --shell /usr/sbin/nologin \
    ${groups:+--groups "${groups%,}"} edgerun
  say "created the system user edgerun"
fi

# 3. configuration and data directories
install -d -m 0755 "$ROOT/etc/edgerun/devices" "$ROOT/var/lib/edgerun/bundles"
install -m 0644 "$SRC"/configs/*.yaml "$ROOT/etc/edgerun/devices/"
if [ -e "$ROOT/etc/edgerun/serve.yaml" ]; then
  say "kept the existing $ROOT/etc/edgerun/serve.yaml"
else
  install -m 0644 "$SRC/systemd/serve.yaml" "$ROOT/etc/edgerun/serve.yaml"
  say "wrote $ROOT/etc/edgerun/serve.yaml: set its model (a bundle) and profile"
fi

# 4. the units, ExecStart naming this venv, verified as installed
units=$ROOT/etc/systemd/system
install -d -m 0755 "$units"
sed "s|^ExecStart=/opt/edgerun/venv/bin/edgerun |ExecStart=$VENV/bin/edgerun |" \
  "$SRC/systemd/edgerun.service" > "$units/edgerun.service"
install -m 0644 "$SRC/systemd/edgerun.socket" "$units/edgerun.socket"
chmod 0644 "$units/edgerun.service"
if command -v systemd-analyze >/dev/null 2>&1; then
  out=$(cd "$units" && systemd-analyze verify --man=no edgerun.service edgerun.socket 2>&1) \
    || { echo "$out" >&2; echo "install.sh: error: the installed units fail systemd-analyze verify" >&2; exit 1; }
  [ -z "$out" ] || { echo "$out" >&2; echo "install.sh: error: systemd-analyze verify warns (above)" >&2; exit 1; }
  say "systemd-analyze verify: ok"
else
  say "systemd-analyze not found: units not verified"
fi

# 5. start
if [ -z "$ROOT" ] && [ "$START" = 1 ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable --now edgerun.socket edgerun.service
  say "started; journalctl -u edgerun -f shows the provenance line"
else
  say "not started (systemctl enable --now edgerun.socket edgerun.service)"
fi

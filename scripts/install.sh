#!/usr/bin/env bash
# Install edgerun as a system service, as docs/serving.md ("Running under systemd") describes:
#   a venv under PREFIX with edgerun installed from this checkout (not editable: the unit's
#   ProtectHome=yes hides home directories), with the [serve] extra and, where an NVIDIA GPU is
#   (a Jetson or nvidia-smi), the [gpu] extra (triton); the `edgerun` service account; /etc/edgerun
#   (serve.yaml from systemd/serve.yaml unless one exists, the device profiles, an edited one kept
#   and the shipped one written beside it as .new); the units with ExecStart naming the venv,
#   checked by `systemd-analyze verify`; then enabled. A first install starts only the socket
#   (set serve.yaml's model, then `systemctl start edgerun`); a later one restarts a running daemon.
#
#   sudo scripts/install.sh [--prefix /opt/edgerun] [--torch SPEC|system] [--gpu auto|yes|no]
#                           [--root DIR] [--no-start]
#   sudo scripts/install.sh --uninstall [--prefix /opt/edgerun]   # keeps /etc/edgerun, /var/lib/edgerun
#
# --torch: a pip requirement for PyTorch (default: torch>=2.4), or `system` to use the torch the
#   system Python already has (JetPack's, on a Jetson: the venv then sees system site-packages).
# --root DIR: write what goes under /etc and /var/lib into DIR instead (a test, or an image being
#   staged): no account, no systemctl. The venv still goes to PREFIX, as the unit names it.
set -euo pipefail
umask 022  # the service account reads the venv and the configuration whatever root's umask is

PREFIX=/opt/edgerun ROOT="" TORCH="torch>=2.4" GPU=auto START=1 UNINSTALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$(realpath -m "$2"); shift 2 ;;
    --root) ROOT=$(realpath -m "$2"); shift 2 ;;
    --torch) TORCH=$2; shift 2 ;;
    --gpu) GPU=$2; shift 2 ;;
    --no-start) START=0; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "install.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$GPU" in auto|yes|no) ;; *) echo "install.sh: error: --gpu must be auto, yes or no, got $GPU" >&2; exit 2 ;; esac
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || { echo "install.sh: error: run as root (or with --root DIR)" >&2; exit 2; }
# the prefix goes into the unit's ExecStart (a sed replacement, a systemd command line)
case "$PREFIX" in
  *[[:space:]\&\|%\\\"\']*) echo "install.sh: error: --prefix $PREFIX: spaces, quotes and & | % \\ are not supported" >&2; exit 2 ;;
esac

SRC=$(cd "$(dirname "$0")/.." && pwd)
VENV=$PREFIX/venv
say() { echo "install.sh: $*"; }

if [ "$UNINSTALL" = 1 ]; then
  if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now edgerun.socket edgerun.service 2>/dev/null || true
  fi
  rm -f "$ROOT/etc/systemd/system/edgerun.service" "$ROOT/etc/systemd/system/edgerun.socket"
  [ -n "$ROOT" ] || { [ ! -d /run/systemd/system ] || systemctl daemon-reload; }
  rm -rf "$PREFIX" "$ROOT/var/cache/edgerun" "$ROOT/run/edgerun"
  if [ -z "$ROOT" ] && id edgerun >/dev/null 2>&1; then userdel edgerun || true; fi
  say "removed the units, $PREFIX and the caches; kept $ROOT/etc/edgerun and $ROOT/var/lib/edgerun (models)"
  exit 0
fi

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
if [ "$TORCH" = system ]; then
  # the system's torch (JetPack's 2.x.0a0+...nv builds do not satisfy torch>=2.4 as pip reads a
  # pre-release): pinned, so that pip fails rather than install another torch over it
  v=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)') \
    || { echo "install.sh: error: --torch system: the system Python has no torch" >&2; exit 2; }
  constraints=$(mktemp); trap 'rm -f "$constraints"' EXIT
  echo "torch==$v" > "$constraints"
  "${pip[@]}" -c "$constraints" "$SRC[$extras]"
else
  "${pip[@]}" "$TORCH"
  "${pip[@]}" "$SRC[$extras]"
fi
"$VENV/bin/edgerun" --version

# 2. the service account (groups video and render reach a Jetson's GPU devices)
groups=$(for g in video render; do if getent group "$g" >/dev/null; then printf '%s,' "$g"; fi; done)
if [ -z "$ROOT" ] && ! id edgerun >/dev/null 2>&1; then
  useradd --system --user-group --home-dir /var/lib/edgerun --no-create-home --shell /usr/sbin/nologin \
    ${groups:+--groups "${groups%,}"} edgerun
  say "created the system user edgerun${groups:+ (groups ${groups%,})}"
elif [ -z "$ROOT" ] && [ -n "$groups" ]; then
  usermod -aG "${groups%,}" edgerun
fi

# 3. configuration and data directories
install -d -m 0755 "$ROOT/etc/edgerun/devices" "$ROOT/var/lib/edgerun/bundles"
for f in "$SRC"/configs/*.yaml; do  # a profile edited here is kept; the shipped one goes beside it
  dst="$ROOT/etc/edgerun/devices/$(basename "$f")"
  if [ -e "$dst" ] && ! cmp -s "$f" "$dst"; then
    install -m 0644 "$f" "$dst.new"
    say "kept the edited $dst; the shipped profile is $dst.new"
  else
    install -m 0644 "$f" "$dst"
  fi
done
first=1
if [ -e "$ROOT/etc/edgerun/serve.yaml" ]; then
  first=0
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

# 5. enable; start the socket, and the daemon only once serve.yaml names a model (an upgrade
# restarts a running daemon on the new code; nothing waits for a model to load)
if [ -z "$ROOT" ] && [ "$START" = 1 ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable edgerun.socket edgerun.service
  systemctl start edgerun.socket
  if [ "$first" = 1 ]; then
    say "enabled; set the model (a bundle) and profile in /etc/edgerun/serve.yaml, then: systemctl start edgerun"
  else
    systemctl try-restart --no-block edgerun.service
    say "enabled; a running daemon restarts on the new code (journalctl -u edgerun -f)"
  fi
else
  say "not started (systemctl enable --now edgerun.socket edgerun.service)"
fi

# Sourced by scripts/up and scripts/test: install, with apt, what building dyn needs plus any
# extra Debian packages named as arguments (when their command is missing), and check for Rust.
install_prereqs() {
  local need=()
  command -v protoc >/dev/null || need+=(protobuf-compiler)   # etcd-client's build script
  [ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
  command -v gcc >/dev/null || need+=(build-essential)
  command -v make >/dev/null || need+=(make)                  # UCX's build (dyn-ucx)
  local pkg cmd
  for pkg in "$@"; do              # PACKAGE:COMMAND
    cmd=${pkg#*:}; pkg=${pkg%%:*}
    command -v "$cmd" >/dev/null || [ -x "/usr/sbin/$cmd" ] || need+=("$pkg")
  done
  [ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"
  if ! command -v cargo >/dev/null; then
    echo "Rust is not installed: install it with rustup (https://rustup.rs), then run this again." >&2
    exit 1
  fi
  export PATH="$PATH:/usr/sbin"
}

apt_install() {
  echo "==> Installing $*"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@"
}

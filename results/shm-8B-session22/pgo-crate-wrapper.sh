#!/bin/bash
# RUSTC_WRAPPER: adds -Cprofile-use for crates listed in PGO_CRATES (space separated)
rustc="$1"; shift
name=""
prev=""
for a in "$@"; do [ "$prev" = "--crate-name" ] && name="$a"; prev="$a"; done
for c in $PGO_CRATES; do
  if [ "$c" = "$name" ]; then exec "$rustc" "$@" -Cprofile-use=/tmp/s22/merged.profdata -Wunknown-lints; fi
done
exec "$rustc" "$@"

# Sourced by scripts/test and .ci/run: scratch space for what the tests and the demo write (the demo's CPU torch
# generation, the suite's hosts and builds). A machine's /tmp can be a small tmpfs, so TMPDIR becomes the first
# of TMPDIR (else /tmp), /var/tmp and HOME with 8 GiB free; where none has, it stays as it was.
for _d in "${TMPDIR:-/tmp}" /var/tmp "$HOME"; do
  if [ -d "$_d" ] && [ -w "$_d" ] && [ "$(df -Pk "$_d" | awk 'NR == 2 {print $4}')" -ge $((8 << 20)) ]; then
    export TMPDIR=$_d; break
  fi
done
unset _d
echo "scratch: ${TMPDIR:-/tmp} ($(df -Ph "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}') free)" >&2

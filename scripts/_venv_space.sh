# Sourced by scripts/setup_sglang.sh and scripts/setup_vllm.sh: refuse to build an engine's venv
# where the disk cannot hold it, before pip starts (rather than fail half-way with "No space left
# on device": a CI run did, on a disk that earlier clones had filled). pip unpacks each wheel
# through a temporary folder, so that folder needs room too.
#
#   need_space WHAT VENV NEED_GB NEED_TMP_GB OVERRIDE_VAR VENV_GB
need_space() {
  local what=$1 venv=$2 need_gb=$3 need_tmp_gb=$4 override=$5 venv_gb=$6 free_gb tmp_gb
  free_gb=$(df -Pk "$(dirname "$(realpath -m "$venv")")" | awk 'NR == 2 {print int($4 / 1048576)}')
  tmp_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-0}" -lt "$need_gb" ] || [ "${tmp_gb:-0}" -lt "$need_tmp_gb" ]; then
    echo "$what: needs about $need_gb GB free beside $venv and $need_tmp_gb GB in ${TMPDIR:-/tmp};" \
         "found ${free_gb} GB beside $venv and ${tmp_gb} GB in ${TMPDIR:-/tmp}." \
         "Free some space (old clones' $(basename "$venv") are $venv_gb GB each) or set $override." >&2
    exit 1
  fi
}

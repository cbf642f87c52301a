#!/usr/bin/env bash
# `make test`: every suite, side by side, with the engines' venvs built beside the main suite.
#
# The main suite (.venv, built before this runs) starts at once. Beside it, .venv-sglang and
# .venv-vllm are built (each behind its stamp: a built one costs nothing) while a few main-suite
# tests run in .venv (SIDE_TESTS, below); then the SGLang suite, then the vLLM suite: at most two
# suites share the two cores at any time. (Three at once,
# or the main suite in two shards beside both, saturated the cores: tests that start real
# servers then missed their start-up deadlines, in a fresh-clone run.) Each suite writes its own
# log; the logs are printed in a fixed order once all have ended, each with its summary, and the
# script fails when any suite failed (or a venv failed to build).
#
# KVBRIDGE_TEST_SHARDS=2 runs the main suite in two shards (tests/transfer and the rest), for a
# host with cores to spare.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
MAKE=${MAKE:-make}
SHARDS=${KVBRIDGE_TEST_SHARDS:-1}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-tests.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT
PYTEST=(-m pytest -q -p no:cacheprovider --durations=30)
ENGINE_SUITES=(--ignore=tests/integrations/sglang --ignore=tests/integrations/vllm)
# Main-suite tests that run in .venv beside the engine venvs' build instead of in the main suite:
# the engines' lane (venvs, then the SGLang and vLLM suites) ended 300-400 s before the main
# suite, so these move over to even the two lanes (tiny models colocated against disaggregated,
# the workers' commands, the demo, the doctor). The chaos runs stay in the main suite: their
# verdicts wait on real rooms under load, and the side lane is the busier one while the venvs build.
SIDE_TESTS=(tests/integrations/transformers tests/worker tests/test_demo.py tests/doctor)
SIDE_IGNORED=()
for path in "${SIDE_TESTS[@]}"; do SIDE_IGNORED+=("--ignore=$path"); done
start=$(date +%s)

declare -A pids=()
run() {  # run NAME CMD...: in the background, output to its log, its exit code kept
  local name=$1; shift
  ( "$@" > "$LOGS/$name.log" 2>&1; echo $? > "$LOGS/$name.rc"; \
    echo "$(( $(date +%s) - start ))" > "$LOGS/$name.end" ) &
  pids[$name]=$!
}

if [ "$SHARDS" = 1 ]; then
  run main "$VENV/bin/python" "${PYTEST[@]}" "${ENGINE_SUITES[@]}" "${SIDE_IGNORED[@]}"
  names=(main)
else
  # each shard its own --basetemp: two pytest processes share no temporary folder
  run main-transfer "$VENV/bin/python" "${PYTEST[@]}" --basetemp="$LOGS/tmp-transfer" tests/transfer
  run main-rest "$VENV/bin/python" "${PYTEST[@]}" --basetemp="$LOGS/tmp-rest" "${ENGINE_SUITES[@]}" \
    "${SIDE_IGNORED[@]}" --ignore=tests/transfer
  names=(main-transfer main-rest)
fi

engines() {
  # both venvs build while the side tests run; then the SGLang suite, then the vLLM suite
  "$MAKE" --no-print-directory setup-vllm > "$LOGS/vllm-venv.log" 2>&1 &
  local vllm_venv=$!
  "$MAKE" --no-print-directory setup-sglang > "$LOGS/sglang-venv.log" 2>&1 &
  local sglang_venv=$!
  "$VENV/bin/python" "${PYTEST[@]}" --basetemp="$LOGS/tmp-side" "${SIDE_TESTS[@]}" > "$LOGS/side.log" 2>&1
  echo $? > "$LOGS/side.rc"
  echo "side tests (.venv) ended after $(( $(date +%s) - start )) s"
  wait "$sglang_venv" || {
    echo "the SGLang venv failed to build:"; tail -40 "$LOGS/sglang-venv.log"; wait "$vllm_venv"; return 1; }
  echo "SGLang venv ready after $(( $(date +%s) - start )) s"
  "$SGLANG_VENV/bin/python" "${PYTEST[@]}" tests/integrations/sglang > "$LOGS/sglang.log" 2>&1
  echo $? > "$LOGS/sglang.rc"
  echo "SGLang suite ended after $(( $(date +%s) - start )) s"
  wait "$vllm_venv" || { echo "the vLLM venv failed to build:"; tail -40 "$LOGS/vllm-venv.log"; return 1; }
  echo "vLLM venv ready after $(( $(date +%s) - start )) s"
  KVBRIDGE_REQUIRE_VLLM=1 "$VLLM_VENV/bin/python" "${PYTEST[@]}" tests/integrations/vllm > "$LOGS/vllm.log" 2>&1
  echo $? > "$LOGS/vllm.rc"
  echo "vLLM suite ended after $(( $(date +%s) - start )) s"
}
run engines engines
names+=(engines)

for name in "${names[@]}"; do wait "${pids[$name]}"; done

rc=0
show() {  # show TITLE NAME
  echo "== $1"
  cat "$LOGS/$2.log" 2>/dev/null
  local code; code=$(cat "$LOGS/$2.rc" 2>/dev/null || echo 1)
  [ "$code" = 0 ] || { echo "-- $1 exited $code"; rc=1; }
}
for name in "${names[@]}"; do
  [ "$name" = engines ] && continue
  show "main suite: $name (.venv, ended after $(cat "$LOGS/$name.end") s)" "$name"
done
show "engine venvs" engines
show "side tests (.venv: ${SIDE_TESTS[*]})" side
show "SGLang suite (.venv-sglang)" sglang
show "vLLM suite (.venv-vllm)" vllm
echo "== make test: $(( $(date +%s) - start )) s, $([ $rc = 0 ] && echo passed || echo FAILED)"
exit $rc

# Sourced by the issue-33 device scripts (issue33_ab.sh, issue33_r12.sh, r12b, r13, r14, r15, r18, r19, r20, r21, r22, r23), run as run_gpu.sh's
# EXTRA: where run_gpu.sh put the carried wheels, the filter that drops native log lines, and the
# tree a before/after row runs ($BEFORE, default _before: an older tree unpacked beside this one by
# `git archive <rev> kvbridge scripts | tar -x -C _before`; anything else: this tree).
site=/tmp/site
B=${BEFORE:-_before}
quiet() { grep -v "^[IWE][0-9]\{4\} "; }
tree() { [ "$1" = before ] && echo "$PWD/$B" || echo "$PWD"; }

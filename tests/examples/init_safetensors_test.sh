#!/usr/bin/env bash
# --init_safetensors: a run exports its model after 3 steps; a second run started from that
# file must say so and begin from the trained parameters (its first loss, on the same first
# batch, is lower than the first run's); a model of another shape is an error naming the
# tensor. The same run's --export_hf_dir (files of at most 300 KB with an index) starts a run
# with the same first loss as the file; an export directory holding a file of the user's is
# bad usage naming it, before training.
#
# Usage: init_safetensors_test.sh TRAIN_GPT
set -uo pipefail
program=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(--batch 4 --seq 32 --eval_every 0 --sample_tokens 0 --log_every 1 --lr 3e-3 --warmup 0)
failed=0
check() {  # check OK DESCRIPTION
  if [ "$1" = 1 ]; then echo "  ok      $2"; else echo "  FAILED  $2"; failed=1; fi
}
run() {  # run OUT EXPECTED_RC ARGS...
  local out=$1 want=$2
  shift 2
  echo "command: $program ${args[*]} $*"
  timeout -k 5 240 "$program" "${args[@]}" "$@" >"$out" 2>&1
  local rc=$?
  check "$([ $rc = "$want" ] && echo 1)" "exit code $rc, expected $want"
}
first_loss() { sed -n 's/^step     1\/[0-9]* | loss \([0-9.]*\) .*/\1/p' "$1"; }

run "$dir/a.txt" 0 --steps 3 --export_safetensors "$dir/m.safetensors" --export_hf_dir "$dir/hf" \
  --export_max_file_mb 0.3
check "$(grep -qF "exported $dir/hf in the Hugging Face layout: 2 files" "$dir/a.txt" && echo 1)" \
  "output says: exported $dir/hf in the Hugging Face layout: 2 files"
check "$([ -f "$dir/hf/model.safetensors.index.json" ] && [ -f "$dir/hf/model-00002-of-00002.safetensors" ] && echo 1)" \
  "the directory holds the index and 2 files"
run "$dir/b.txt" 0 --steps 1 --init_safetensors "$dir/m.safetensors"
check "$(grep -qF "initialised the parameters from $dir/m.safetensors" "$dir/b.txt" && echo 1)" \
  "output says: initialised the parameters from $dir/m.safetensors"
a=$(first_loss "$dir/a.txt") b=$(first_loss "$dir/b.txt")
check "$(awk -v a="$a" -v b="$b" 'BEGIN { print (a != "" && b != "" && b < a - 0.05) ? 1 : 0 }')" \
  "first loss from the file ($b) is below the first loss from scratch ($a)"
run "$dir/c.txt" 1 --steps 1 --init_safetensors "$dir/m.safetensors" --layers 3
check "$(grep -qF "tensor 'transformer.h.2.ln_1.weight' of this model is not in the file" "$dir/c.txt" && echo 1)" \
  "another shape: the error names the missing tensor"
run "$dir/d.txt" 0 --steps 1 --init_safetensors "$dir/hf"
d=$(first_loss "$dir/d.txt")
check "$([ -n "$d" ] && [ "$d" = "$b" ] && echo 1)" \
  "first loss from the directory ($d) is the first loss from the file ($b)"
echo "mine" >"$dir/hf/notes.txt"
run "$dir/e.txt" 2 --steps 1 --export_hf_dir "$dir/hf"
check "$(grep -qF "holds notes.txt, which an export does not write" "$dir/e.txt" && echo 1)" \
  "a directory with a file of the user's: bad usage naming it"
check "$(grep -q "^step" "$dir/e.txt" || echo 1)" "nothing trained"
if [ $failed != 0 ]; then
  for f in a b c d e; do echo "---- run $f ----"; cat "$dir/$f.txt"; done
fi
exit $failed

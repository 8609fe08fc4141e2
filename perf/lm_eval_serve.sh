#!/usr/bin/env bash
# lm-eval 0.4.13 (not installed by CI: `pip install 'lm-eval[api]==0.4.13'`, ~760 MB, ~10 min on a shared 2-core
# host; the `api` extra is what its API models need) against `dflash-trt serve` on a converted checkpoint, as
# lm-eval runs against vLLM: the `local-completions` model, its tokenizer taken from the server (/tokenizer_info,
# /tokenize, /detokenize: no model hub), prompts sent as token ids in batches (a list of prompts per request).
#
#   perf/lm_eval_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]
#
# The task is the tiny pair's held-out arithmetic (dflash_trt/assets/tiny_pair/heldout.jsonl, 200 problems): greedy
# answers, the number after "ans" compared with the expected answer (exact match). Settings: BATCH_SIZE (4),
# NUM_CONCURRENT (2), PORT (8013), MAX_BATCH_SIZE (8). lm-eval's results land in OUTPUT_DIR/results, its log in
# OUTPUT_DIR/lm_eval.log, the server's log and metrics beside them.
set -euo pipefail

checkpoint=${1:?usage: perf/lm_eval_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]}
out=$(mkdir -p "${2:-lm_eval_serve_out}" && cd "${2:-lm_eval_serve_out}" && pwd)
port=${PORT:-8013}
python=${PYTHON:-python}
command -v lm_eval >/dev/null || { echo "lm_eval not found: pip install 'lm-eval[api]==0.4.13'" >&2; exit 2; }
heldout=$("$python" -c "from dflash_trt.tiny.heldout import asset_dir; print(asset_dir() / 'heldout.jsonl')")

mkdir -p "$out/tasks"
cat >"$out/tasks/tiny_arith.yaml" <<YAML
task: tiny_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: $heldout
test_split: test
output_type: generate_until
doc_to_text: "{{text}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  max_gen_toks: 64
  do_sample: false
  temperature: 0
filter_list:
  - name: ans
    filter:
      - function: regex
        regex_pattern: "ans (\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    higher_is_better: true
YAML

"$python" -m dflash_trt.cli serve --checkpoint_dir "$checkpoint" --port "$port" --served_model_name dflash \
    --max_batch_size "${MAX_BATCH_SIZE:-8}" >"$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$out/serve.log" >&2; exit 1; }
    sleep 0.5
done

HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions \
    --model_args "model=dflash,base_url=http://127.0.0.1:$port/v1/completions,num_concurrent=${NUM_CONCURRENT:-2}" \
    --include_path "$out/tasks" --tasks tiny_arith --batch_size "${BATCH_SIZE:-4}" \
    --output_path "$out/results" 2>"$out/lm_eval.log"
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"

#!/usr/bin/env bash
# guidellm 0.8.1 (an external load generator, not installed by CI: `pip install guidellm==0.8.1` pulls torch with
# its CUDA wheels, ~6 GB and ~15 min on a shared 2-core host) against `dflash-trt serve` on a converted checkpoint,
# as guidellm runs by default: the chat endpoint, streaming, synthetic prompts of ISL tokens asking for OSL tokens.
#
#   perf/guidellm_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]
#
# guidellm sends `ignore_eos: true` with a fixed output length, so the server runs with --ignore_eos (each request
# then produces exactly OSL tokens); it sends `stream_options.continuous_usage_stats`, which serve honours. The
# checkpoint's tokenizer needs a chat template (the tiny pair ships one; CHAT_TEMPLATE=FILE gives one to a
# tokenizer without). guidellm tokenizes its synthetic prompts with the checkpoint's tokenizer, offline.
# Settings: CONCURRENCY (8), REQUESTS (64), ISL (64), OSL (64), PORT (8012), MAX_BATCH_SIZE (8). guidellm's report
# lands in OUTPUT_DIR/guidellm.json, its console tables in OUTPUT_DIR/guidellm.txt, the server's log beside them.
set -euo pipefail

checkpoint=${1:?usage: perf/guidellm_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]}
out=${2:-guidellm_serve_out}
port=${PORT:-8012}
python=${PYTHON:-python}
command -v guidellm >/dev/null || { echo "guidellm not found: pip install guidellm==0.8.1" >&2; exit 2; }
template=()
[ -n "${CHAT_TEMPLATE:-}" ] && template=(--chat_template "$CHAT_TEMPLATE")

mkdir -p "$out"
"$python" -m dflash_trt.cli serve --checkpoint_dir "$checkpoint" --port "$port" --served_model_name dflash \
    --max_batch_size "${MAX_BATCH_SIZE:-8}" --ignore_eos "${template[@]}" >"$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$out/serve.log" >&2; exit 1; }
    sleep 0.5
done

HF_HUB_OFFLINE=1 guidellm run \
    --backend "kind=openai_http,target=http://127.0.0.1:$port,model=dflash" \
    --tokenizer "kind=huggingface_auto,model=$checkpoint" \
    --profile "kind=concurrent,streams=${CONCURRENCY:-8}" \
    --constraint "kind=max_requests,count=${REQUESTS:-64}" \
    --data "kind=synthetic_text,prompt_tokens=${ISL:-64},output_tokens=${OSL:-64}" \
    --output "kind=json,path=$out/guidellm.json" \
    --disable-progress | tee "$out/guidellm.txt"
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"

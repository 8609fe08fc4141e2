#!/usr/bin/env bash
# aiperf 0.13 (an external load generator, not installed by CI: `pip install aiperf==0.13.0`, ~1.2 GB) against
# `dflash-trt serve` on a converted checkpoint, through the chat endpoint with streaming.
#
#   perf/aiperf_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]
#
# The checkpoint's tokenizer gets a minimal chat template (in a copy under OUTPUT_DIR) when it has none, so the
# chat endpoint can render prompts; aiperf counts tokens with the same copy. The server runs with --ignore_eos and
# every request sends ignore_eos, so each produces exactly OSL tokens; aiperf counts output tokens from the
# server's usage (re-tokenizing the text undercounts: special tokens are not part of it). Settings: CONCURRENCY (8), REQUESTS (64),
# ISL (64), OSL (64), PORT (8011), MAX_BATCH_SIZE (8). aiperf's own report lands in OUTPUT_DIR/aiperf.
set -euo pipefail

checkpoint=${1:?usage: perf/aiperf_serve.sh CHECKPOINT_DIR [OUTPUT_DIR]}
out=${2:-aiperf_serve_out}
concurrency=${CONCURRENCY:-8}
requests=${REQUESTS:-64}
isl=${ISL:-64}
osl=${OSL:-64}
port=${PORT:-8011}
python=${PYTHON:-python}
command -v aiperf >/dev/null || { echo "aiperf not found: pip install aiperf==0.13.0" >&2; exit 2; }

mkdir -p "$out"
tokenizer="$out/tokenizer"
"$python" - "$checkpoint" "$tokenizer" <<'EOF'
import json, shutil, sys
from pathlib import Path

source, target = Path(sys.argv[1]), Path(sys.argv[2])
target.mkdir(parents=True, exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt"):
    if (source / name).is_file():
        shutil.copy(source / name, target / name)
config_path = target / "tokenizer_config.json"
config = json.loads(config_path.read_text()) if config_path.is_file() else {}
config.setdefault(
    "chat_template",
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
)
config_path.write_text(json.dumps(config))
EOF

"$python" -m dflash_trt.cli serve --checkpoint_dir "$checkpoint" --tokenizer_dir "$tokenizer" --port "$port" \
    --served_model_name dflash --max_batch_size "${MAX_BATCH_SIZE:-8}" --ignore_eos >"$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$out/serve.log" >&2; exit 1; }
    sleep 0.5
done

aiperf profile \
    --model dflash \
    --tokenizer "$tokenizer" \
    --url "http://127.0.0.1:$port" \
    --endpoint-type chat \
    --streaming \
    --concurrency "$concurrency" \
    --request-count "$requests" \
    --synthetic-input-tokens-mean "$isl" \
    --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$osl" \
    --output-tokens-stddev 0 \
    --extra-inputs ignore_eos:true \
    --use-server-token-count \
    --random-seed 123 \
    --artifact-dir "$out/aiperf"
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"

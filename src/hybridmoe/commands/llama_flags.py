"""llama-server flags that mean nothing here, so a llama-server command line still starts `serve`:
they are set aside (warned about by serve) before argparse sees them.

Setting them aside first matters for the single-dash ones: argparse would read `-ctk q8_0` as
`-c tk` and `-tb 8` as `-t b`. The table gives each flag's value count (llama.cpp's
common/arg.cpp); a value is only taken when the next word is not itself a flag, so a miscounted
flag never swallows one of ours. Flags missing from the table still reach argparse, which leaves
them over (`parse_known_args`); they are ignored the same way.
"""

from __future__ import annotations

import argparse

_NO_VALUE = """
-cb --cont-batching -nocb --no-cont-batching -kvu --kv-unified --no-kv-unified --no-warmup --warmup
-nkvo --no-kv-offload --kv-offload --no-op-offload --no-perf --perf --check-tensors -e --escape
--no-escape --no-webui --webui --embedding --embeddings --reranking --rerank --props
--no-prefill-assistant -nr --no-repack --repack -dkvc --dump-kv-cache --offline --log-disable
--log-prefix --log-timestamps -sp --special --no-mmproj --no-mmproj-offload --mmproj-offload
--verbose-prompt -dio --direct-io --no-host --no-jinja --spm-infill --lora-init-without-apply
-cmoed --cpu-moe-draft --endpoint-metrics --endpoint-props --endpoint-slots --no-endpoint-slots
--models-autoload --no-models-autoload
--spec-draft-cpu-moe --spec-draft-backend-sampling --no-spec-draft-backend-sampling
-bs --backend-sampling --reasoning-preserve --no-reasoning-preserve --reuse-port --log-jsonl --no-log-jsonl
--list-devices -cl --cache-list --completion-bash -ag --agent -no-ag --no-agent --ui-mcp-proxy --webui-mcp-proxy
--no-ui-mcp-proxy --no-webui-mcp-proxy --gpt-oss-20b-default --gpt-oss-120b-default --embd-gemma-default
--fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec --fim-qwen-14b-spec
--fim-qwen-30b-default --vision-gemma-4b-default --vision-gemma-12b-default
"""

_ONE_VALUE = """
-ctkd --cache-type-k-draft -ctvd --cache-type-v-draft
-tb --threads-batch -C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch
-Crb --cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch -dev --device -ts --tensor-split
-sm --split-mode -mg --main-gpu --numa -to --timeout --threads-http --cache-reuse -dt --defrag-thold
-hf -hfr --hf-repo -hff --hf-file -hft --hf-token -hfd -hfrd --hf-repo-draft -hfv -hfrv --hf-repo-v
-hffv --hf-file-v -mu --model-url -md --model-draft -ngld --gpu-layers-draft --n-gpu-layers-draft
-devd --device-draft -ncmoed --n-cpu-moe-draft -otd --override-tensor-draft --draft-max --draft
--draft-n --draft-min --draft-n-min --draft-p-min -cd --ctx-size-draft -td --threads-draft
-tbd --threads-batch-draft -mm --mmproj -mmu --mmproj-url -mv --model-vocoder --lora
--control-vector --override-kv --rope-scaling --rope-scale --rope-freq-base --rope-freq-scale
--yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast
-gan --grp-attn-n -gaw --grp-attn-w --keep --grammar --grammar-file -j --json-schema
-jf --json-schema-file
--path --api-prefix --ssl-key-file --ssl-cert-file --log-file --log-colors -lv --verbosity
--log-verbosity -sps --slot-prompt-similarity --media-path --models-dir
--models-max --models-preset --webui-config --webui-config-file --image-min-tokens
--image-max-tokens --fit-target -fitt --fit-ctx -fitc --pooling -r --reverse-prompt
--n-probs --cache-type-k-draft --chat-template-file-draft
--spec-draft-n-max --spec-draft-n-min --spec-draft-p-min --spec-draft-p-split --spec-draft-model
--spec-draft-hf --spec-draft-ngl --spec-draft-device --spec-draft-threads --spec-draft-threads-batch
--spec-draft-type-k --spec-draft-type-v --spec-draft-override-tensor --spec-draft-n-cpu-moe --spec-draft-ncmoe
--spec-draft-cpu-mask --spec-draft-cpu-mask-batch --spec-draft-cpu-range --spec-draft-cpu-strict
--spec-draft-cpu-strict-batch --spec-draft-prio --spec-draft-prio-batch --spec-draft-poll --spec-draft-poll-batch
--spec-ngram-mod-n-match --spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-map-k-size-n
--spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits --spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m
--spec-ngram-map-k4v-min-hits --spec-synth-len --spec-synth-rates
-ncffn --n-cpu-ffn -lm --load-mode -lzm --lazy-mode --rpc -dr --docker-repo -lcs --lookup-cache-static
-lcd --lookup-cache-dynamic --kv-unified-per-slot -mmdev --mmproj-device --mtmd-batch-max-tokens --video-fps
--video-timestamp-interval --video-ffmpeg-dir --embd-normalize --tools --tools-runtime --mcp-servers-config
--mcp-servers-json --sleep-idle-seconds --log-prompts-dir --spec-ngram-size-n --spec-ngram-size-m
--spec-ngram-min-hits
"""

_TWO_VALUES = "--lora-scaled --control-vector-scaled --control-vector-layer-range --spec-replace"

# flag -> how many values follow it
LLAMA_SERVER_ONLY_FLAGS: dict[str, int] = {
    **{f: 0 for f in _NO_VALUE.split()},
    **{f: 1 for f in _ONE_VALUE.split()},
    **{f: 2 for f in _TWO_VALUES.split()},
}


def is_flag(word: str) -> bool:
    """A word argparse would read as an option: a leading '-' that does not start a number."""
    if not word.startswith("-") or word == "-":
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False


def set_aside(argv: list[str]) -> tuple[list[str], list[str]]:
    """(words for argparse, llama-server-only flags with their values), order kept."""
    kept: list[str] = []
    foreign: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        n_values = LLAMA_SERVER_ONLY_FLAGS.get(word.split("=", 1)[0]) if is_flag(word) else None
        if n_values is None:
            kept.append(word)
            i += 1
            continue
        foreign.append(word)
        i += 1
        if "=" not in word:
            for _ in range(n_values):
                if i < len(argv) and not is_flag(argv[i]):
                    foreign.append(argv[i])
                    i += 1
    return kept, foreign


def parse_llama_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a command line that may carry llama-server flags this program does not have; they
    and any other unknown words end up in `args.unknown_flags` (flags with their values)."""
    kept, foreign = set_aside(argv)
    args, leftovers = parser.parse_known_args(kept)
    args.unknown_flags = [*foreign, *leftovers]
    return args

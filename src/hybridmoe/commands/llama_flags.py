"""llama-server's command lines and environment, so a llama-server setup still starts `serve`.

Its flags that mean nothing here are set aside (warned about by serve) before argparse sees them.
Its LLAMA_ARG_* environment variables become the flags they stand for, ahead of the command line.

Setting them aside first matters for the single-dash ones: argparse would read `-ctk q8_0` as
`-c tk` and `-tb 8` as `-t b`. The table gives each flag's value count (llama.cpp's
common/arg.cpp); a value is only taken when the next word is not itself a flag, so a miscounted
flag never swallows one of ours. Flags missing from the table still reach argparse, which leaves
them over (`parse_known_args`); they are ignored the same way.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

_NO_VALUE = """
-cb --cont-batching -nocb --no-cont-batching -kvu --kv-unified --no-kv-unified --no-warmup --warmup
-nkvo --no-kv-offload --kv-offload --no-op-offload --no-perf --perf -e --escape
--no-escape --embedding --embeddings --reranking --rerank --props
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
--show-timings --no-show-timings --mmproj-auto --no-mmproj-auto --prefill-assistant
"""

_ONE_VALUE = """
-ctkd --cache-type-k-draft -ctvd --cache-type-v-draft
-tb --threads-batch -C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch
-Crb --cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch -dev --device -ts --tensor-split
-sm --split-mode -mg --main-gpu --numa -to --timeout --threads-http --cache-reuse -dt --defrag-thold
-hft --hf-token -hfd -hfrd --hf-repo-draft -hfv -hfrv --hf-repo-v
-hffv --hf-file-v -mu --model-url -md --model-draft -ngld --gpu-layers-draft --n-gpu-layers-draft
-devd --device-draft -ncmoed --n-cpu-moe-draft -otd --override-tensor-draft --draft-max --draft
--draft-n --draft-min --draft-n-min --draft-p-min -cd --ctx-size-draft -td --threads-draft
-tbd --threads-batch-draft -mm --mmproj -mmu --mmproj-url -mv --model-vocoder --lora
--control-vector --override-kv --rope-scaling --rope-scale --rope-freq-base --rope-freq-scale
--yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast
-gan --grp-attn-n -gaw --grp-attn-w --keep --grammar --grammar-file -j --json-schema
-jf --json-schema-file
--log-colors -lv --verbosity
--log-verbosity -sps --slot-prompt-similarity --media-path --models-dir
--models-max --models-preset --image-min-tokens
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
-ncffn --n-cpu-ffn -lzm --lazy-mode --rpc -dr --docker-repo -lcs --lookup-cache-static
-lcd --lookup-cache-dynamic --kv-unified-per-slot -mmdev --mmproj-device --mtmd-batch-max-tokens --video-fps
--video-timestamp-interval --video-ffmpeg-dir --embd-normalize --tools --tools-runtime --mcp-servers-config
--mcp-servers-json --sleep-idle-seconds --log-prompts-dir --spec-ngram-size-n --spec-ngram-size-m
--spec-ngram-min-hits -fitp --fit-print --spec-draft-sampling
"""

_TWO_VALUES = "--lora-scaled --control-vector-scaled --control-vector-layer-range --spec-replace"

# flag -> how many values follow it
LLAMA_SERVER_ONLY_FLAGS: dict[str, int] = {
    **{f: 0 for f in _NO_VALUE.split()},
    **{f: 1 for f in _ONE_VALUE.split()},
    **{f: 2 for f in _TWO_VALUES.split()},
}


# llama-server's environment variables (llama.cpp common/arg.cpp, `set_env`), each with the flag it
# stands for. A flag that has a --no- form can also be turned off by LLAMA_ARG_NO_<NAME> (any value).
_ENV_FLAGS = """
LLAMA_ARG_THREADS --threads  LLAMA_ARG_CTX_SIZE --ctx-size  LLAMA_ARG_N_PREDICT --n-predict
LLAMA_ARG_BATCH --batch-size  LLAMA_ARG_UBATCH --ubatch-size  LLAMA_ARG_SWA_FULL --swa-full
LLAMA_ARG_CTX_CHECKPOINTS --ctx-checkpoints  LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT --checkpoint-min-step
LLAMA_ARG_CACHE_RAM --cache-ram  LLAMA_ARG_CACHE_IDLE_SLOTS --cache-idle-slots
LLAMA_ARG_CONTEXT_SHIFT --context-shift  LLAMA_ARG_FLASH_ATTN --flash-attn  LLAMA_ARG_TEMPERATURE --temp
LLAMA_ARG_TOP_K --top-k  LLAMA_ARG_TOP_P --top-p  LLAMA_ARG_MIN_P --min-p  LLAMA_ARG_REPEAT_PENALTY --repeat-penalty
LLAMA_ARG_PRESENCE_PENALTY --presence-penalty  LLAMA_ARG_FREQUENCY_PENALTY --frequency-penalty
LLAMA_ARG_CACHE_TYPE_K --cache-type-k  LLAMA_ARG_CACHE_TYPE_V --cache-type-v  LLAMA_ARG_N_PARALLEL --parallel
LLAMA_ARG_OVERRIDE_TENSOR --override-tensor  LLAMA_ARG_CPU_MOE --cpu-moe  LLAMA_ARG_N_CPU_MOE --n-cpu-moe
LLAMA_ARG_N_GPU_LAYERS --n-gpu-layers  LLAMA_ARG_FIT --fit  LLAMA_ARG_ALIAS --alias  LLAMA_ARG_TAGS --tags
LLAMA_ARG_MODEL --model  LLAMA_ARG_HOST --host  LLAMA_ARG_PORT --port  LLAMA_ARG_CORS_ORIGINS --cors-origins
LLAMA_ARG_CORS_METHODS --cors-methods  LLAMA_ARG_CORS_HEADERS --cors-headers
LLAMA_ARG_CORS_CREDENTIALS --cors-credentials  LLAMA_API_KEY --api-key  LLAMA_ARG_API_KEY_FILE --api-key-file
LLAMA_ARG_CHAT_TEMPLATE_KWARGS --chat-template-kwargs  LLAMA_ARG_SSE_PING_INTERVAL --sse-ping-interval
LLAMA_ARG_CACHE_PROMPT --cache-prompt  LLAMA_ARG_ENDPOINT_METRICS --metrics  LLAMA_ARG_ENDPOINT_SLOTS --slots
LLAMA_ARG_JINJA --jinja  LLAMA_ARG_THINK --reasoning-format  LLAMA_ARG_REASONING --reasoning
LLAMA_ARG_REASONING_EFFORT --reasoning-effort  LLAMA_ARG_THINK_BUDGET --reasoning-budget
LLAMA_ARG_THINK_BUDGET_MESSAGE --reasoning-budget-message  LLAMA_ARG_CHAT_TEMPLATE --chat-template
LLAMA_ARG_CHAT_TEMPLATE_FILE --chat-template-file  LLAMA_ARG_SKIP_CHAT_PARSING --skip-chat-parsing
LLAMA_ARG_SPEC_TYPE --spec-type  LLAMA_ARG_API_PREFIX --api-prefix  LLAMA_ARG_SSL_KEY_FILE --ssl-key-file
LLAMA_ARG_SSL_CERT_FILE --ssl-cert-file  LLAMA_ARG_LOAD_MODE --load-mode  LLAMA_ARG_LOG_FILE --log-file
LLAMA_ARG_UI --ui
LLAMA_ARG_KV_UNIFIED_PER_SLOT --kv-unified-per-slot  LLAMA_ARG_KV_UNIFIED --kv-unified  LLAMA_ARG_PERF --perf
LLAMA_ARG_SHOW_TIMINGS --show-timings  LLAMA_ARG_BACKEND_SAMPLING --backend-sampling  LLAMA_ARG_POOLING --pooling
LLAMA_ARG_ROPE_SCALING_TYPE --rope-scaling  LLAMA_ARG_ROPE_SCALE --rope-scale  LLAMA_ARG_ROPE_FREQ_BASE --rope-freq-base
LLAMA_ARG_ROPE_FREQ_SCALE --rope-freq-scale  LLAMA_ARG_YARN_ORIG_CTX --yarn-orig-ctx
LLAMA_ARG_YARN_EXT_FACTOR --yarn-ext-factor  LLAMA_ARG_YARN_ATTN_FACTOR --yarn-attn-factor
LLAMA_ARG_YARN_BETA_SLOW --yarn-beta-slow  LLAMA_ARG_YARN_BETA_FAST --yarn-beta-fast  LLAMA_ARG_GRP_ATTN_N --grp-attn-n
LLAMA_ARG_GRP_ATTN_W --grp-attn-w  LLAMA_ARG_KV_OFFLOAD --kv-offload  LLAMA_ARG_REPACK --repack
LLAMA_ARG_NO_HOST --no-host  LLAMA_ARG_DEFRAG_THOLD --defrag-thold  LLAMA_ARG_CONT_BATCHING --cont-batching
LLAMA_ARG_MMPROJ --mmproj  LLAMA_ARG_MMPROJ_URL --mmproj-url  LLAMA_ARG_MMPROJ_AUTO --mmproj-auto
LLAMA_ARG_MMPROJ_OFFLOAD --mmproj-offload  LLAMA_ARG_IMAGE_MIN_TOKENS --image-min-tokens
LLAMA_ARG_IMAGE_MAX_TOKENS --image-max-tokens  LLAMA_ARG_MTMD_BATCH_MAX_TOKENS --mtmd-batch-max-tokens
LLAMA_ARG_VIDEO_FPS --video-fps  LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL --video-timestamp-interval
LLAMA_ARG_VIDEO_FFMPEG_DIR --video-ffmpeg-dir  LLAMA_ARG_RPC --rpc  LLAMA_ARG_LAZY_MODE --lazy-mode
LLAMA_ARG_NUMA --numa
LLAMA_ARG_DEVICE --device  LLAMA_ARG_N_CPU_FFN --n-cpu-ffn  LLAMA_ARG_SPLIT_MODE --split-mode
LLAMA_ARG_TENSOR_SPLIT --tensor-split  LLAMA_ARG_MAIN_GPU --main-gpu  LLAMA_ARG_FIT_ESTIMATE --fit-print
LLAMA_ARG_FIT_TARGET --fit-target  LLAMA_ARG_FIT_CTX --fit-ctx  LLAMA_ARG_MODEL_URL --model-url
LLAMA_ARG_DOCKER_REPO --docker-repo  LLAMA_ARG_HF_REPO --hf-repo  LLAMA_ARG_HF_FILE --hf-file
LLAMA_ARG_REUSE_PORT --reuse-port  LLAMA_ARG_STATIC_PATH --path  LLAMA_ARG_UI_CONFIG --ui-config
LLAMA_ARG_UI_CONFIG_FILE --ui-config-file  LLAMA_ARG_UI_MCP_PROXY --ui-mcp-proxy  LLAMA_ARG_TOOLS --tools
LLAMA_ARG_TOOLS_RUNTIME --tools-runtime  LLAMA_ARG_MCP_SERVERS_CONFIG --mcp-servers-config
LLAMA_ARG_MCP_SERVERS_JSON --mcp-servers-json  LLAMA_ARG_AGENT --agent  LLAMA_ARG_EMBEDDINGS --embeddings
LLAMA_ARG_RERANKING --reranking  LLAMA_ARG_TIMEOUT --timeout  LLAMA_ARG_THREADS_HTTP --threads-http
LLAMA_ARG_CACHE_REUSE --cache-reuse  LLAMA_ARG_ENDPOINT_PROPS --props  LLAMA_ARG_MODELS_DIR --models-dir
LLAMA_ARG_MODELS_PRESET --models-preset  LLAMA_ARG_MODELS_MAX --models-max  LLAMA_ARG_MODELS_AUTOLOAD --models-autoload
LLAMA_ARG_REASONING_PRESERVE --reasoning-preserve  LLAMA_ARG_PREFILL_ASSISTANT --prefill-assistant
LLAMA_ARG_LOG_JSONL --log-jsonl  LLAMA_ARG_LOG_COLORS --log-colors  LLAMA_ARG_OFFLINE --offline
LLAMA_ARG_LOG_VERBOSITY --log-verbosity  LLAMA_ARG_LOG_PREFIX --log-prefix  LLAMA_ARG_LOG_TIMESTAMPS --log-timestamps
LLAMA_ARG_SPEC_DRAFT_HF_REPO --hf-repo-draft  LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K --cache-type-k-draft
LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V --cache-type-v-draft  LLAMA_ARG_SPEC_DRAFT_CPU_MOE --cpu-moe-draft
LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE --n-cpu-moe-draft  LLAMA_ARG_SPEC_DRAFT_N_MAX --spec-draft-n-max
LLAMA_ARG_SPEC_DRAFT_N_MIN --spec-draft-n-min  LLAMA_ARG_SPEC_SYNTH_LEN --spec-synth-len
LLAMA_ARG_SPEC_SYNTH_RATES --spec-synth-rates  LLAMA_ARG_SPEC_DRAFT_P_SPLIT --spec-draft-p-split
LLAMA_ARG_SPEC_DRAFT_P_MIN --spec-draft-p-min  LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING --spec-draft-backend-sampling
LLAMA_ARG_SPEC_DRAFT_SAMPLING --spec-draft-sampling  LLAMA_ARG_N_GPU_LAYERS_DRAFT --n-gpu-layers-draft
LLAMA_ARG_SPEC_DRAFT_MODEL --model-draft  LLAMA_ARG_DRAFT_MAX --draft-max  LLAMA_ARG_DRAFT_MIN --draft-min
"""
# Variables llama-server does not read, for its flags that have none: a container setup can still
# switch them on the same way.
_OUR_ENV_FLAGS = "LLAMA_ARG_CHECK_TENSORS --check-tensors"
_env_words = (_ENV_FLAGS + _OUR_ENV_FLAGS).split()
LLAMA_ENV_FLAGS: dict[str, str] = dict(zip(_env_words[::2], _env_words[1::2]))
TRUTHY = frozenset({"on", "enabled", "true", "1"})  # llama.cpp's spellings of a boolean value
FALSEY = frozenset({"off", "disabled", "false", "0"})


def _negative_form(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """--no-X when the parser has it for the same setting as --X."""
    action = parser._option_string_actions.get(flag)
    neg = parser._option_string_actions.get("--no-" + flag.removeprefix("--"))
    return "--no-" + flag.removeprefix("--") if action is not None and neg is not None and neg.dest == action.dest \
        else None


def _checked_value(env: str, flag: str, action: argparse.Action, value: str) -> None:
    """The error argparse would give for the flag, naming the variable instead."""
    try:
        converted = action.type(value) if callable(action.type) else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"environment variable {env}: invalid value {value!r} for {flag}"
                         + (f": {e}" if str(e) else "")) from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"environment variable {env}: {value!r} for {flag} is not one of "
                         f"{', '.join(map(str, action.choices))}")


def environment_words(parser: argparse.ArgumentParser, environ: Mapping[str, str]
                      ) -> tuple[list[str], list[str], list[str]]:
    """(flags the LLAMA_ARG_* variables in environ stand for, the variables used, notes on those set
    aside), as llama-server reads them: a switch takes on/true/1/enabled (off/false/0/disabled
    gives its --no- form, if any), a valued flag its value as is. ValueError on a value the flag
    would refuse, naming the variable."""
    words: list[str] = []
    used: list[str] = []
    notes: list[str] = []
    for env, flag in LLAMA_ENV_FLAGS.items():
        no_env = env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if env.startswith("LLAMA_ARG_") else None
        action = parser._option_string_actions.get(flag)
        if action is None:  # a flag set aside: so are its variables
            notes += [f"ignoring environment variable {name} ({flag}): it has no meaning in hybridmoe"
                      for name in (env, no_env) if name is not None and name in environ]
            continue
        negative = _negative_form(parser, flag)
        if negative is not None and no_env in environ:  # any value, as llama-server
            words.append(negative)
            used.append(no_env)
            continue
        if env not in environ:
            continue
        value = environ[env]
        if action.nargs != 0:
            _checked_value(env, flag, action, value)
            words.append(f"{flag}={value}")
        elif value.lower() in TRUTHY:
            words.append(flag)
        elif value.lower() in FALSEY:
            if negative is not None:
                words.append(negative)
        elif negative is not None:
            raise ValueError(f"environment variable {env}: expected on/off, true/false, 1/0 or enabled/disabled, "
                             f"got {value!r}")
        else:
            notes.append(f"environment variable {env}={value!r} is not on/true/1/enabled: {flag} stays off")
            continue
        used.append(env)
    return words, used, notes


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


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise KeyError(command)


def parse_llama_command_line(parser: argparse.ArgumentParser, argv: list[str],
                             environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse `COMMAND ...` (argv[0] a subcommand of parser) as llama-server would: its LLAMA_ARG_*
    variables from environ (default os.environ) first, as flags the command line can override; flags
    this program does not have and any other unknown words end up in `args.unknown_flags` (with their
    values). `args.env_used` / `args.env_notes` say which variables were read and which were set aside."""
    command = _command_parser(parser, argv[0])
    try:
        env_words, used, notes = environment_words(command, os.environ if environ is None else environ)
    except ValueError as e:
        command.error(str(e))
    kept, foreign = set_aside([argv[0], *env_words, *argv[1:]])
    args, leftovers = parser.parse_known_args(kept)
    args.unknown_flags = [*foreign, *leftovers]
    args.env_used, args.env_notes = used, notes
    return args

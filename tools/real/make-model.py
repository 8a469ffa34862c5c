"""Builds a tiny Qwen2-architecture model directory for `vllm serve --load-format dummy`.

Nothing is downloaded: the config is written here, and the tokenizer (byte-level BPE, trained
with the `tokenizers` package) learns its merges from this repository's own text (its READMEs and
Rust sources). The weights are vLLM's dummy (random) ones, so the answers are nonsense; what the
benchmark and the tests need is real prompt processing, a real prefix cache, real metrics and
real KV events.

Usage: make-model.py REPO_ROOT OUT_DIR
"""

import json
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 8192
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's ChatML template, tools left out: the benchmark sends plain chat turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(root: pathlib.Path):
    """The repository's text, in a fixed order: READMEs, then Rust sources."""
    files = sorted(root.glob("*.md")) + sorted(root.glob("*/README.md"))
    for sub in ("src", "sim/src", "bench/src", "harness/src"):
        files += sorted((root / sub).rglob("*.rs"))
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


def main():
    root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(root), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        # Head size 64: the CPU attention backend refuses 16 or 32.
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 16384,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": eos,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 16384,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2) + "\n"
    )
    print(f"make-model: {out} (vocab {vocab})")


if __name__ == "__main__":
    main()

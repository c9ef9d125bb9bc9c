#!/usr/bin/env python3
"""Build the tiny Llama checkpoint the real-engine tests serve with vLLM.

Nothing is downloaded: a byte-level BPE tokenizer is trained here with the
`tokenizers` package on test/interop/testdata/corpus.txt, and a 2-layer
Llama model gets weights from a fixed seed. Both are written with
save_pretrained into OUT (default .interop/model/tiny-llama). The output is
deterministic: the same files, byte for byte, on every run; the script prints
a digest of them so a run can be compared with another.

Greedy decoding of random weights gives meaningless but exactly reproducible
tokens, which is all the tests' oracle (PD output == unified output) needs.

Usage: make-tiny-model.py [--out DIR] [--force]
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, "test", "interop", "testdata", "corpus.txt")
DEFAULT_OUT = os.path.join(REPO, ".interop", "model", "tiny-llama")

# Bump when the recipe below changes, so an old cached model is rebuilt.
RECIPE = "tiny-llama-v1"
SEED = 1234
VOCAB = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def digest(out):
    h = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        if name == "recipe.json":
            continue
        with open(os.path.join(out, name), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def build_tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    # Train on fixed-size chunks in file order: deterministic merges.
    chunks = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out, vocab_size, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: a size vLLM's CPU attention supports
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        # A wide init so the next token depends on the context (a narrow one
        # makes greedy decoding repeat one token).
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    # generation_config.json would carry sampling defaults vLLM applies;
    # the tests set every sampling parameter themselves.
    gc = os.path.join(out, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("INTEROP_MODEL", DEFAULT_OUT))
    ap.add_argument("--force", action="store_true", help="rebuild even if the recipe is cached")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    stamp = os.path.join(out, "recipe.json")
    if not args.force and os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f).get("recipe") == RECIPE:
                print(f"tiny model: {out} (cached, digest {digest(out)})")
                return 0
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok = build_tokenizer(tmp)
    build_model(tmp, len(tok), tok)
    with open(os.path.join(tmp, "recipe.json"), "w") as f:
        json.dump({"recipe": RECIPE, "seed": SEED}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"tiny model: {out} (built, vocab {len(tok)}, digest {digest(out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

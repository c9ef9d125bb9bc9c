#!/usr/bin/env python3
"""Write the tokenizer test vectors of internal/tokenizer/testdata.

The expected ids come from HuggingFace `tokenizers` itself
(Tokenizer.encode(text, add_special_tokens=...)), run from the interop venv
(scripts/install-interop.sh; tokenizers 0.23.3 when these were made):

  ~/.cache/switchyard-interop/venv/bin/python scripts/make-tokenizer-vectors.py

Three tokenizers:
  tiny-llama.json  the tiny model's tokenizer (scripts/make-tiny-model.py),
                   copied from .interop/model/tiny-llama/tokenizer.json:
                   ByteLevel(use_regex) pre-tokenizer, GPT-2 pattern.
  llama3ish.json   trained here: Split(Llama-3 pattern) + ByteLevel
                   (use_regex=false), ignore_merges, TemplateProcessing BOS,
                   special and non-special added tokens; merges written in
                   the old "a b" string form.
  qwen2ish.json    trained here: NFC + Split(Qwen2 pattern) + ByteLevel,
                   TemplateProcessing BOS/EOS, ChatML special tokens, an
                   lstrip/rstrip added token, a normalized special token.
Training is deterministic (fixed corpus, single thread), so reruns give the
same files. vectors.json holds, per tokenizer, every text with both
add_special_tokens values and the ids.
"""

import json
import os
import random
import shutil
import sys

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import AddedToken

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "internal", "tokenizer", "testdata")
TINY = os.path.join(REPO, ".interop", "model", "tiny-llama", "tokenizer.json")
if not os.path.exists(TINY):
    TINY = "/work/main/.interop/model/tiny-llama/tokenizer.json"

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026, isn't it? We'll see.",
    "I've been there; they'd said you're right, I'm sure. DON'T SHOUT, HE'S HERE.",
    "def main():\n    print('hello, world')\n\treturn 42\n\n\n",
    "Numbers: 1234567890 3.14159 1,000,000 -17 +42 0x1F 12345678901234567890",
    "Ünïcödé café naïve résumé Ærøskøbing façade coöperate über Straße",
    "日本語のテキストと中文文本和한국어 텍스트 混在しています。",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧 ❤️ 🇫🇷 and symbols ©®™ ± × ÷ → ∞",
    "Русский текст и ελληνικά γράμματα, עברית ועربي",
    "   leading spaces, trailing spaces    \n  \n\r\n tabs\t\tand\nnewlines  ",
    "<html><body class=\"x\">a &amp; b</body></html> {\"json\": [1, 2, 3]}",
] * 20

TEXTS = [
    "",
    " ",
    "  ",
    "hello",
    " hello",
    "Hello world",
    "Hello  world",
    "Hello   world   ",
    "It's I'm you're we've they'll he'd don't",
    "IT'S I'M YOU'RE WE'VE THEY'LL HE'D DON'T",
    "'s 'S 'ſ 'ſt x'Re",
    "digits 1 12 123 1234 12345 123456 1234567",
    "3.14159 and 1,000,000 and 2026-12-01T16:05Z",
    "a\nb\n\nc\n\n\nd",
    "line\r\nline\r\n\r\n",
    "\n\n  \n",
    "tabs\there\t\tand\t \tthere",
    "trailing space ",
    "trailing spaces   ",
    "   ",
    "\u00a0nbsp\u00a0\u00a0x \u3000ideographic\u3000space",
    "\u2028line sep\u2029para\u0085nel\u000bvt\u000cff",
    "Emoji 😀🎉👍🏽 👨‍👩‍👧 ❤️ 🇫🇷!",
    "日本語のテキスト、中文文本。한국어",
    "Ünïcödé café naïve",
    "cafe\u0301 vs café (NFC)",
    "Å vs A\u030a and \u212b (angstrom)",
    "Русский текст",
    "mixed123abc456 x1y22z333",
    "punct!!! ??? ... --- ___ *** ((( )))",
    " ?! ?!\n?!\r\n",
    "$$$100 €200 £300 ¥400",
    "def f(x):\n    return x**2\n\n\nprint(f(3))\n",
    "<html><body>a &amp; b</body></html>",
    "{\"key\": [1, 2, {\"k\": null}]}",
    "a" * 300,
    "ab " * 50,
    "word " * 200,
    "\t\n \t\n",
    "x  \n  y",
    "x \n\n y",
    "x\t\ny",
    "¹²³ ½ ⅓ Ⅻ ٣٤٥ ๑๒",
    "\u0000nul\u0001ctl\u007fdel",
    "\ufeffbom and \ufffd replacement",
]

SPECIAL_TEXTS = {
    "tiny-llama.json": [
        "<s>", "</s>", "<s>hello</s>", "a<s>b", "hello<s> world</s>", " <s> ", "<s><s></s>", "<pad>x<pad>",
        "in<s>side", "<s", "s>", "</s >",
    ],
    "llama3ish.json": [
        "<|begin_of_text|>hello", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        "word<|eot_id|>word", "<|eot_id|><|eot_id|>", "<|eot_id", " <|eot_id|> ",
        "xx[tool]yy", " [tool] ", "a  [tool]  b", "[tool][tool]", "[TOOL]",
    ],
    "qwen2ish.json": [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        "in<|im_end|>side", "<|endoftext|>", "<|im_start|><|im_end|>",
        "<r\u00e9f>", "x<re\u0301f>y", "<re\u0301f><r\u00e9f>", "a <mark> b", "a<mark>b", "a   <mark>   b", "\n<mark>\n", "<mark>", "café<mark>cafe\u0301",
    ],
}


def fuzz_texts(seed, n):
    rng = random.Random(seed)
    pieces = ["a", "Z", "é", "e\u0301", "日", "한", "😀", "👍🏽", "1", "23", "٣", "Ⅻ", " ", "  ", "\t", "\n", "\r\n",
              "\u00a0", "\u3000", "'s", "'T", "'ll", "'", "!", "?!", ".", ",", "-", "$", "(", ")", "\"", "<", ">",
              "<s>", "</s>", "<|eot_id|>", "<|im_end|>", "[tool]", "<mark>", "word", "Hello", "ſ"]
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))))
    return out


def corpus_iter():
    for line in CORPUS:
        yield line


def train(kind):
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    pattern = LLAMA3 if kind == "llama3" else QWEN2
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    if kind == "llama3":
        special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    else:
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_iter(), trainer=trainer)
    if kind == "llama3":
        tok.add_tokens([AddedToken("[tool]", single_word=False, lstrip=False, rstrip=False, normalized=True, special=False)])
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    else:
        tok.add_tokens([AddedToken("<mark>", single_word=False, lstrip=True, rstrip=True, normalized=True, special=False)])
        # A special token matched in the NFC-normalized text (normalized=True).
        tok.add_special_tokens([AddedToken("<r\u00e9f>", single_word=False, lstrip=False, rstrip=False, normalized=True, special=True)])
        bos, eos = "<|im_start|>", "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"$A {eos} $B:1 {eos}:1",
            special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return tok


def main():
    os.makedirs(OUT, exist_ok=True)
    shutil.copyfile(TINY, os.path.join(OUT, "tiny-llama.json"))
    for kind, name in (("llama3", "llama3ish.json"), ("qwen2", "qwen2ish.json")):
        path = os.path.join(OUT, name)
        train(kind).save(path, pretty=False)
        if kind == "llama3":  # the older "a b" merges form
            d = json.load(open(path, encoding="utf-8"))
            d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(d, f, ensure_ascii=False, separators=(",", ":"))
    vectors = {}
    for i, name in enumerate(("tiny-llama.json", "llama3ish.json", "qwen2ish.json")):
        tok = Tokenizer.from_file(os.path.join(OUT, name))
        cases = []
        for text in TEXTS + SPECIAL_TEXTS[name] + fuzz_texts(i, 150):
            for add in (True, False):
                cases.append({"text": text, "add_special_tokens": add, "ids": tok.encode(text, add_special_tokens=add).ids})
        vectors[name] = cases
    with open(os.path.join(OUT, "vectors.json"), "w", encoding="utf-8") as f:
        json.dump(vectors, f, ensure_ascii=False, indent=0)
    print("wrote", OUT, {k: len(v) for k, v in vectors.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()

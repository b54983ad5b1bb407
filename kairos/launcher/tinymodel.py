"""A tiny Llama model directory built locally, so tests and demos never touch a model hub.

``build_tiny_model`` trains a byte-level BPE tokenizer on a generated English-like corpus and
writes the files a Hugging Face model directory needs (``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``config.json``, ``generation_config.json``).
There are no weights: real vLLM serves it with ``--load-format dummy``, which is all a gateway
test needs (the text it generates is noise, the token accounting is real).

Everything is deterministic for a given ``(vocab_size, seed)``, so token counts asserted in
tests stay exact across machines. A stamp file makes a second build of the same directory free.

It ships, though tests use it most: ``kairos up`` (the README's main command) builds it for the
emulated cluster's tokenizer, and ``kairos tiny-model`` and the compose file's one-shot ``model``
service build it for users with no model at hand.

    python -m kairos.launcher.tinymodel OUT_DIR [--vocab-size 4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kairos.common import defaults

# Bump when anything below changes what is written: stale stamps then force a rebuild.
BUILDER_VERSION = 1
STAMP_FILE = ".kairos-tinymodel.json"

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)  # trained first, so ids 0, 1, 2
MAX_MODEL_LEN = defaults.MAX_MODEL_LEN
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")

# Zephyr-style turns: a role header, the content, EOS closing the turn (so a model that stops on
# EOS ends its own turn), BOS once at the start like Llama. Content is a string or a list of
# OpenAI text parts; iterating ``message['content']`` makes vLLM detect the "openai" content
# format, so vLLM hands lists to the template as they are. Written on one line so that
# trim_blocks/lstrip_blocks cannot change the output.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}"
    "{{ part['text'] }}"
    "{% else %}"
    "{{ raise_exception('unsupported content part type: ' ~ part['type']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token ~ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)

# Common English words: the skeleton of the corpus, so frequent merges look like English.
_COMMON_TEXT = """
the of and to in a is that for it as was with be by on not he i this are or his from at which
but have an they you were her she there one all we their can has been if more when will would
who so no out up into do any time about than them some could only other new its our these two
may first then what also over after where most made like did many before must through back years
much way well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same another
know while last might us great old year off come since against go came right used take three
states himself few house use during without again place around however home small found mrs
thought went say part once general high upon school every don does got united left number course
war until always away something fact though water less public put think almost hand enough far
took head yet government system better set told nothing night end why called didn eyes find going
look asked later knew point next program city business give group toward young days let room
president side social given present several order national possible rather second face per among
form important often things looked early white case john become large big need four within felt
along children saw best church ever least power development light thing seemed family interest
want members others mind country area done turned although open god service problem certain kind
different thus began door help means sense whole matter perhaps itself york times law human line
above name example action company hands local show five history whether gave either act feet
across taken past quite anything seen having death week experience body word half really field
am car words already themselves information tell together college shall money period held keep
sure real probably free seems political cannot behind miss question air office making brought
whose special heard major problems ago became federal moment study available known result street
economic boy position reason change south board individual job society areas west close turn love
community true court force full seem am model request token server decode prefill cache memory
latency batch queue node cluster schedule chunk deflect transfer network gateway router stream
"""

_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "br",
    "ch",
    "cl",
    "cr",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "sl",
    "sp",
    "st",
    "str",
    "th",
    "tr",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "rt", "st", "ck", "ll", "ss")
_SUFFIXES = ("", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able", "ful")


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word: one to three syllables and an English-looking suffix."""
    syllables = rng.choice((1, 1, 2, 2, 2, 3))
    word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables))
    return word + rng.choice(_SUFFIXES)


def _corpus(seed: int, target_chars: int = 400_000) -> Iterator[str]:
    """Paragraphs of English-like sentences with Zipf-distributed words, numbers and punctuation."""
    rng = random.Random(seed)
    lexicon = list(dict.fromkeys(_COMMON_TEXT.split() + [_pseudo_word(rng) for _ in range(3000)]))
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    produced = 0
    while produced < target_chars:
        sentences = []
        for _ in range(rng.randint(3, 8)):
            words = rng.choices(lexicon, weights, k=rng.randint(4, 20))
            if rng.random() < 0.15:
                words.insert(rng.randrange(len(words)), str(rng.choice((rng.randint(0, 99), rng.randint(1900, 2030)))))
            if len(words) > 6 and rng.random() < 0.4:
                words[rng.randrange(2, len(words) - 1)] += ","
            words[0] = words[0].capitalize()
            sentences.append(" ".join(words) + rng.choice(".....?!"))
        paragraph = " ".join(sentences)
        produced += len(paragraph) + 1
        yield paragraph


def _train_tokenizer(vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk> ever
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama: BOS before every sequence when add_special_tokens=True.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _model_files(vocab_size: int, seed: int) -> dict[str, str]:
    """The text of every file in the model directory."""
    tokenizer = _train_tokenizer(vocab_size, seed)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    actual_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_MODEL_LEN,
        "added_tokens_decoder": {
            str(ids[tok]): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "vocab_size": actual_vocab,
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    generation_config = {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN]}

    def dump(obj: Any) -> str:
        return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"

    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": dump(tokenizer_config),
        "config.json": dump(config),
        "generation_config.json": dump(generation_config),
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stamp_matches(out_dir: Path, vocab_size: int, seed: int) -> bool:
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text())
        if (stamp.get("builder_version"), stamp.get("vocab_size"), stamp.get("seed")) != (
            BUILDER_VERSION,
            vocab_size,
            seed,
        ):
            return False
        return all(_sha256(out_dir / name) == digest for name, digest in stamp["files"].items()) and set(
            stamp["files"]
        ) == set(MODEL_FILES)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a concurrent reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a vLLM container running as another user must read it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_tiny_model(out_dir: Path, *, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Write the tiny Llama model directory into ``out_dir`` (created if needed) and return it.

    Skips the work when ``out_dir`` already holds the files of the same build (checked by hash
    against the stamp file), so test sessions and scripts can call it unconditionally.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        minimum = len(SPECIAL_TOKENS) + 256
        raise ValueError(f"vocab_size must be at least {minimum} (special tokens + 256 bytes), got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if _stamp_matches(out_dir, vocab_size, seed):
        return out_dir
    files = _model_files(vocab_size, seed)
    for name, text in files.items():
        _write_atomic(out_dir / name, text)
    stamp = {
        "builder_version": BUILDER_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "files": {name: _sha256(out_dir / name) for name in files},
    }
    _write_atomic(out_dir / STAMP_FILE, json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kairos.launcher.tinymodel", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model files into")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = build_tiny_model(args.out_dir, vocab_size=args.vocab_size, seed=args.seed)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

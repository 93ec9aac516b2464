"""Tokenizer, chat template and streaming decoder.

SmolLM2 (fixture `smollm2_dir`) is checked against transformers' AutoTokenizer;
tiny in-memory `tokenizers` models cover metadata resolution and error paths.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from evalrun.engine.streaming import StreamingDecoder
from evalrun.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading space",
    "trailing space ",
    "multiple   spaces\tand\ttabs\n\n\nnewlines  \n ",
    "naïve café déjà vu — “quotes” ‘single’ … ß Ω ≠ ∑",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 flags and ZWJ",
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "Ünïcödé ∮ E⋅da = Q, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒮𝒸𝓇𝒾𝓅𝓉",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != 0: pass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> in the middle and <|endoftext|> too",
    "partial <|im_end and <| im_end |> lookalikes",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "   ",
    "\u200b zero width \ufeff bom \u00a0 nbsp",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 中文 😀?"},
    ],
    [{"role": "user", "content": "  spaces \n and <|im_end|> inside  "}],
]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm2_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


# --- SmolLM2 vs transformers ------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_tok, text):
    # Default: special-token strings are plain text (HF's split_special_tokens=True).
    expected = hf_tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.encode(text) == expected
    expected_special = hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, encode_special_tokens=True) == expected_special
    assert tok.encode(text, add_bos=True) == [tok.bos_token_id, *expected]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text, encode_special_tokens=True)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, decode_special_tokens=True) == hf_tok.decode(ids)
    assert tok.decode(tok.encode(text)) == text


def test_decode_random_ids_matches_transformers(tok, hf_tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(tuple(ids), decode_special_tokens=True) == hf_tok.decode(ids)


def test_special_token_strings_are_plain_text_by_default(tok):
    text = "a <|im_end|> b"
    plain = tok.encode(text)
    assert tok.eos_token_id not in plain
    assert tok.decode(plain) == text
    assert tok.eos_token_id in tok.encode(text, encode_special_tokens=True)


def test_failed_encode_leaves_tokenizer_unchanged(tok):
    with pytest.raises(TypeError):
        tok.encode(None, encode_special_tokens=True)  # type: ignore[arg-type]
    assert tok.eos_token_id not in tok.encode("<|im_end|>")
    assert tok.encode("<|im_end|>", encode_special_tokens=True) == [tok.eos_token_id]


def test_special_ids_and_vocab_size(tok, hf_tok, smollm2_dir):
    assert tok.bos_token_id == hf_tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.eos_token_id == hf_tok.eos_token_id == 2
    assert tok.eos_token_ids[0] == tok.eos_token_id
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)
    assert tok.vocab_size == len(hf_tok)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert tok.vocab_size <= config["vocab_size"]
    assert tok.id_to_piece(tok.eos_token_id) == "<|im_end|>"
    with pytest.raises(ValueError):
        tok.id_to_piece(10**9)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(tok, hf_tok, chat, add_generation_prompt):
    expected = hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == expected


# --- streaming ----------------------------------------------------------------


def _stream(tok, ids, decode_special_tokens=False):
    dec = StreamingDecoder(tok, decode_special_tokens=decode_special_tokens)
    pushes = [dec.push(i) for i in ids]
    return pushes, dec.flush()


def _check_stream(tok, ids, decode_special_tokens=False):
    full = tok.decode(ids, decode_special_tokens=decode_special_tokens)
    pushes, tail = _stream(tok, ids, decode_special_tokens)
    assert "".join(pushes) + tail == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in chunk for chunk in pushes)
        assert tail == ""


def test_multibyte_characters_span_several_tokens(tok):
    # Guards the streaming tests below: they must exercise held-back bytes.
    ids = tok.encode("👨‍👩‍👧‍👦")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])


@pytest.mark.parametrize("decode_special_tokens", [False, True])
def test_streaming_reassembles_text(tok, decode_special_tokens):
    for text in TEXTS:
        _check_stream(tok, tok.encode(text, encode_special_tokens=True), decode_special_tokens)
    chat_ids = tok.encode(tok.apply_chat_template(CHATS[1]), encode_special_tokens=True)
    _check_stream(tok, chat_ids, decode_special_tokens)


def test_streaming_random_ids(tok):
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        _check_stream(tok, ids)


def test_streaming_holds_back_half_characters(tok):
    ids = tok.encode("中文😀")  # 😀's four bytes come in three tokens
    pushes, tail = _stream(tok, ids)
    assert pushes == ["中", "文", "", "", "😀"] and tail == ""


def test_streaming_continues_after_flush(tok):
    ids = tok.encode("one two three")
    dec = tok.streaming_decoder()
    text = "".join(dec.push(i) for i in ids[:2]) + dec.flush()
    text += "".join(dec.push(i) for i in ids[2:]) + dec.flush()
    assert text == "one two three"


# --- tiny in-memory tokenizers: metadata and errors ---------------------------

CORPUS = ["hello world", "hello there world", "the world says hello", "héllo wörld 😀"]


def _train(pre_tokenizer, decoder, special: list[str]) -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    hf.train_from_iterator(CORPUS, trainer=trainer)
    return hf


def _write_model_dir(path: Path, hf: HFTokenizer, **files: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    for name, content in files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return path


@pytest.fixture(scope="module")
def byte_bpe() -> HFTokenizer:
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return _train(pre_tokenizer, decoders.ByteLevel(), ["<s>", "</s>", "<eot>"])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as info:
        Tokenizer.load(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_bos_eos_from_config_strings_and_dicts(tmp_path, byte_bpe):
    tok_config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    gen_config = {"eos_token_id": [byte_bpe.token_to_id("<eot>"), byte_bpe.token_to_id("</s>")]}
    model_dir = _write_model_dir(
        tmp_path, byte_bpe, tokenizer_config=tok_config, generation_config=gen_config
    )
    tok = Tokenizer.load(model_dir)
    assert tok.bos_token_id == byte_bpe.token_to_id("<s>")
    assert tok.eos_token_id == byte_bpe.token_to_id("</s>")
    assert tok.eos_token_ids == [byte_bpe.token_to_id("</s>"), byte_bpe.token_to_id("<eot>")]
    assert tok.vocab_size == byte_bpe.get_vocab_size(with_added_tokens=True)
    assert tok.encode("hello", add_bos=True)[0] == tok.bos_token_id


def test_bos_eos_fall_back_to_model_config(tmp_path, byte_bpe):
    model_dir = _write_model_dir(
        tmp_path, byte_bpe, config={"bos_token_id": 0, "eos_token_id": [1, 2]},
        generation_config={"eos_token_id": 2},
    )
    tok = Tokenizer.load(model_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, [1, 2])


def test_no_bos_and_no_template_errors(tmp_path, byte_bpe):
    model_dir = _write_model_dir(tmp_path, byte_bpe, tokenizer_config={"eos_token": "</s>"})
    tok = Tokenizer.load(model_dir)
    assert tok.bos_token_id is None and tok.eos_token_ids == [tok.eos_token_id]
    assert tok.encode("hello") == byte_bpe.encode("hello", add_special_tokens=False).ids
    with pytest.raises(ValueError, match="BOS"):
        tok.encode("hello", add_bos=True)
    with pytest.raises(ValueError, match="chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(model_dir) in str(info.value)


def _template_tok(tmp_path, byte_bpe, template, jinja_file=None) -> Tokenizer:
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    model_dir = _write_model_dir(tmp_path, byte_bpe, tokenizer_config=config)
    if jinja_file is not None:
        (model_dir / "chat_template.jinja").write_text(jinja_file)
    return Tokenizer.load(model_dir)


def test_chat_template_sources(tmp_path, byte_bpe):
    named = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ bos_token }}"},
    ]
    assert _template_tok(tmp_path / "a", byte_bpe, named).apply_chat_template([]) == "D<s>"
    from_file = _template_tok(tmp_path / "b", byte_bpe, None, jinja_file="F{{ eos_token }}")
    assert from_file.apply_chat_template([]) == "F</s>"
    both = _template_tok(tmp_path / "c", byte_bpe, "C", jinja_file="F")
    assert both.apply_chat_template([]) == "F"        # transformers 5: chat_template.jinja before the config's


def test_chat_template_features(tmp_path, byte_bpe):
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}\n"
        "{% endfor %}{% if add_generation_prompt %}GEN{{ extra }}{% endif %}"
        "{% if messages | length > 3 %}{{ raise_exception('too many') }}{% endif %}"
        "{{ strftime_now('%Y')[:0] }}"
    )
    tok = _template_tok(tmp_path, byte_bpe, template)
    chat = [{"role": "user", "content": "é<b>"}, {"role": "skip", "content": "x"}]
    assert tok.apply_chat_template(chat, extra="!") == '"é<b>"GEN!'  # trim_blocks eats the newline
    assert tok.apply_chat_template(chat, add_generation_prompt=False, extra="!") == '"é<b>"'
    with pytest.raises(jinja2.TemplateError, match="too many"):
        tok.apply_chat_template(chat * 2)


def test_chat_template_is_sandboxed(tmp_path, byte_bpe):
    tok = _template_tok(tmp_path, byte_bpe, "{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])


def test_streaming_sentencepiece_leading_spaces(tmp_path):
    # Metaspace decoders drop the first token's leading space, so per-token
    # decoding would glue words together; the prefix window must not.
    hf = _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), ["<s>", "</s>"])
    tok = Tokenizer.load(_write_model_dir(tmp_path, hf, tokenizer_config={"eos_token": "</s>"}))
    ids = tok.encode("hello world there héllo 😀 world")
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
    for end in range(1, len(ids) + 1):
        _check_stream(tok, ids[:end])


def test_encode_many_equals_encode_one_at_a_time(smollm2_dir):
    tok = Tokenizer.load(smollm2_dir)
    texts = ["<|im_start|>user\nHi<|im_end|>\n", "plain text  with  spaces", "", "\n\nA", "é ü 漢字 🙂"]
    for special in (True, False):
        assert tok.encode_many_as_transformers(texts, special) == [tok.encode_as_transformers(t, special)
                                                                   for t in texts]

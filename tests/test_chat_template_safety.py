"""Chat templates as untrusted input (issue 42): rendering equals transformers', runaway templates are
stopped in one line naming the file, template files that are links or lie outside the model directory
are refused (the hub cache's own links excepted), and the render worker process never outlives its use.

Per-render cost (measured on the 2-core CI box, SmolLM2's template, a 500-character prompt; timing is
not asserted here): ~140 us a render through the worker (14 us of it the render itself), ~37 us a
render with apply_chat_template_many; ~70 ms for the first render (the worker's start).
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest

os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from evalrun.engine.chat_template import ChatTemplateError, ChatTemplateRenderError  # noqa: E402
from evalrun.engine.template_renderer import RenderLimits  # noqa: E402
from evalrun.engine.tokenizer import Tokenizer, TokenizerError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}

# A Qwen3-like template: a system turn, reasoning, enable_thinking, special tokens as variables.
DEFAULT = (
    "{%- if messages and messages[0].role == 'system' %}{{ bos_token }}system\n{{ messages[0].content }}"
    "{{ eos_token }}\n{%- endif %}"
    "{%- for m in messages if m.role != 'system' %}{{ bos_token }}{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{%- endif %}{{ m.content }}{{ eos_token }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
# Trims each message: continue_final_message must then right-strip the cut text (transformers' rule).
TRIMMED = ("{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
TOOL_USE = "{{ tools | tojson }}\n" + DEFAULT
NAMED = {"default": DEFAULT, "trimmed": TRIMMED, "tool_use": TOOL_USE}

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 中文 😀?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
     {"role": "user", "content": "And 3+3?", "name": None}],
]
ENDS_WITH_ASSISTANT = [
    [{"role": "user", "content": "Finish: the answer is"}, {"role": "assistant", "content": "The answer is "}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A:"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

BOMBS = {
    "loop": ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
             "{% endfor %}{% endfor %}{% endfor %}", "CPU time"),
    # doubling: stopped by whichever bound comes first. Its strings fault in ~1 GiB of fresh pages before
    # the memory bound, which took 0.97 s of system CPU on one machine (2026-12-05), near FAST's 1 s.
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s }}", ("memory bound", "CPU time")),
    "multiplication": ("{{ 'x' * 10**10 }}", "memory bound"),
    "filter_argument": ("{{ 'a' | center(10**10) }}", "memory bound"),
    "output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "more than"),
}
FAST = RenderLimits(cpu_seconds=1.0, wall_seconds=20.0)


def write_model(path: Path, tokenizer_json: Path, config: dict, files: dict[str, str] = {}) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="module")
def tokenizer_json(smollm2_dir: Path) -> Path:
    return smollm2_dir / "tokenizer.json"


@pytest.fixture(scope="module", params=["config_list", "files"])
def pair(request, tmp_path_factory, tokenizer_json):
    """(ours, transformers') over one model directory: named templates as a tokenizer_config.json list,
    or as chat_template.jinja + additional_chat_templates/NAME.jinja."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "config_list":
        entries = [{"name": name, "template": text} for name, text in NAMED.items()]
        write_model(path, tokenizer_json, {**CONFIG, "chat_template": entries})
    else:
        files = {"chat_template.jinja": DEFAULT, "additional_chat_templates/trimmed.jinja": TRIMMED,
                 "additional_chat_templates/tool_use.jinja": TOOL_USE}
        write_model(path, tokenizer_json, {**CONFIG, "chat_template": "ignored: the files take priority"}, files)
    ours = Tokenizer.load(path)
    yield ours, transformers.AutoTokenizer.from_pretrained(str(path))
    ours.close()


def both(pair, chat, template=None, add_generation_prompt=True, continue_final_message=False, **kwargs):
    ours, hf = pair
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, chat_template=template, **kwargs)
    got = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template=template, **kwargs)
    return got, expected


# --- equal to transformers --------------------------------------------------------------------------
@pytest.mark.parametrize("template", [None, "default", "trimmed", "tool_use"])
def test_renders_as_transformers(pair, template):
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            got, expected = both(pair, chat, template, add_generation_prompt)
            assert got == expected, (chat, add_generation_prompt)
    ours, _ = pair
    assert ours.apply_chat_template_many(CHATS, template=template) == [
        ours.apply_chat_template(chat, template=template) for chat in CHATS]


@pytest.mark.parametrize("template", [None, "trimmed"])
def test_continue_final_message_as_transformers(pair, template):
    for chat in ENDS_WITH_ASSISTANT:
        got, expected = both(pair, chat, template, add_generation_prompt=False, continue_final_message=True)
        assert got == expected
    # the trailing-whitespace rule: kept where the template keeps it, cut where the template trims it
    assert both(pair, ENDS_WITH_ASSISTANT[0], template, False, True)[0].endswith(
        "The answer is " if template is None else "The answer is")


def test_enable_thinking_and_tools_as_transformers(pair):
    for enable_thinking in (True, False):
        got, expected = both(pair, CHATS[0], enable_thinking=enable_thinking)
        assert got == expected
    got, expected = both(pair, CHATS[1], tools=TOOLS)          # tools pick the "tool_use" template
    assert got == expected and got.startswith('[{"type": "function"')


def test_errors_where_transformers_errs(pair):
    ours, hf = pair
    no_content = [CHATS[0][0], {"role": "assistant", "content": None}]
    for chat, add_generation_prompt in ((ENDS_WITH_ASSISTANT[0], True), (no_content, False)):
        # both flags at once; nothing to continue (a None value is dropped, as transformers drops it)
        with pytest.raises(ValueError):
            hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=True)
        with pytest.raises(ChatTemplateError) as info:
            ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, continue_final_message=True)
        assert "\n" not in str(info.value)


def test_names_and_hashes(pair, tokenizer_json, tmp_path):
    ours, _ = pair
    assert ours.chat_template_names() == ["default", "tool_use", "trimmed"]
    for name, text in NAMED.items():
        assert ours.chat_template_hash(name) == hashlib.sha256(text.encode()).hexdigest()
    assert ours.chat_template_hash() == ours.chat_template_hash("default")
    with pytest.raises(ChatTemplateError, match="no chat template named 'chatml'; it has: default, tool_use, trimmed"):
        ours.apply_chat_template(CHATS[0], template="chatml")
    single = Tokenizer.load(write_model(tmp_path / "single", tokenizer_json, {**CONFIG, "chat_template": DEFAULT}))
    assert single.chat_template_names() == ["default"] and single.chat_template == DEFAULT
    none = Tokenizer.load(write_model(tmp_path / "none", tokenizer_json, CONFIG))
    assert none.chat_template_names() == [] and none.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        none.chat_template_hash()


def test_template_errors_are_one_line_and_jinja_errors(tmp_path, tokenizer_json):
    raising = "{{ raise_exception('Roles must alternate\nuser/assistant') }}"
    tok = Tokenizer.load(write_model(tmp_path, tokenizer_json, {"chat_template": raising}))
    with pytest.raises(ChatTemplateRenderError) as info:
        tok.apply_chat_template(CHATS[0])
    assert str(info.value) == f"chat template {tmp_path / 'tokenizer_config.json'}: Roles must alternate user/assistant"
    assert isinstance(info.value, jinja2.TemplateError)      # callers that catch jinja2's errors still do
    tok.close()


# --- runaway templates --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BOMBS))
def test_bombs_are_stopped_in_one_line(tmp_path, tokenizer_json, name):
    source, says = BOMBS[name]
    model = write_model(tmp_path, tokenizer_json, {}, {"chat_template.jinja": source})
    tok = Tokenizer.load(model, FAST)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(CHATS[0])
    assert time.monotonic() - start < 15                       # a bound, not a benchmark
    message = str(info.value)
    assert message.startswith(f"chat template {model / 'chat_template.jinja'}: rendering ")
    assert any(bound in message for bound in ((says,) if isinstance(says, str) else says)), message
    assert "\n" not in message and not isinstance(info.value, ChatTemplateRenderError)
    tok.close()


# --- the worker process ---------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_worker_is_gone_after_close_and_after_a_bound(tmp_path, tokenizer_json):
    model = write_model(tmp_path, tokenizer_json, {}, {"chat_template.jinja": DEFAULT,
                                                       "additional_chat_templates/bomb.jinja": BOMBS["loop"][0]})
    tok = Tokenizer.load(model, FAST)
    tok.apply_chat_template(CHATS[0])
    first = tok._renderer.pid
    assert first is not None and "torch" not in Path(f"/proc/{first}/maps").read_text()
    with pytest.raises(ChatTemplateError, match="CPU time"):
        tok.apply_chat_template(CHATS[0], template="bomb")
    assert _gone(first) and tok._renderer.pid is None          # killed, not left running
    assert "Be terse." in tok.apply_chat_template(CHATS[1])      # a fresh worker
    second = tok._renderer.pid
    assert second not in (None, first)
    tok.close()
    assert _gone(second) and tok._renderer.pid is None


def test_unanswering_worker_is_killed_at_the_wall_deadline(tmp_path, tokenizer_json):
    tok = Tokenizer.load(write_model(tmp_path, tokenizer_json, {}, {"chat_template.jinja": DEFAULT}),
                         RenderLimits(wall_seconds=1.0))
    expected = tok.apply_chat_template(CHATS[0])
    stopped = tok._renderer.pid
    os.kill(stopped, signal.SIGSTOP)
    with pytest.raises(ChatTemplateError, match="did not finish within 1 s"):
        tok.apply_chat_template(CHATS[0])
    assert _gone(stopped)
    assert tok.apply_chat_template(CHATS[0]) == expected          # a fresh worker
    tok.close()


def test_worker_ends_when_its_parent_dies(tmp_path, tokenizer_json):
    model = write_model(tmp_path, tokenizer_json, {}, {"chat_template.jinja": DEFAULT})
    code = ("import os, sys\nfrom evalrun.engine.tokenizer import Tokenizer\n"
            "tok = Tokenizer.load(sys.argv[1]); tok.apply_chat_template([])\n"
            "print(tok._renderer.pid, flush=True)\nos.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    worker = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker)


# --- template files -----------------------------------------------------------------------------------
def test_links_and_files_outside_are_refused(tmp_path, tokenizer_json):
    (tmp_path / "outside.jinja").write_text(DEFAULT)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.jinja").write_text(DEFAULT)
    inside = write_model(tmp_path / "inside", tokenizer_json, {}, {"real.jinja": DEFAULT})
    (inside / "chat_template.jinja").symlink_to("real.jinja")
    dotdot = write_model(tmp_path / "dotdot", tokenizer_json, {})
    (dotdot / "chat_template.jinja").symlink_to("../outside.jinja")
    linked_dir = write_model(tmp_path / "linked_dir", tokenizer_json, {})
    (linked_dir / "additional_chat_templates").symlink_to(tmp_path / "elsewhere")
    config = write_model(tmp_path / "config", tokenizer_json, {})
    (tmp_path / "outside.json").write_text(json.dumps({"chat_template": DEFAULT}))
    (config / "tokenizer_config.json").unlink()
    (config / "tokenizer_config.json").symlink_to(tmp_path / "outside.json")
    fifo = write_model(tmp_path / "fifo", tokenizer_json, {})
    os.mkfifo(fifo / "chat_template.jinja")
    cases = [(inside, None, "chat_template.jinja", "symbolic link"),
             (dotdot, None, "chat_template.jinja", "symbolic link"),
             (linked_dir, "x", "additional_chat_templates/x.jinja", "outside the model directory"),
             (fifo, None, "chat_template.jinja", "not a regular file")]
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: refused: it is a symbolic link"):
        Tokenizer.load(config)                      # (read when the tokenizer loads: engine/model_files.py)
    for model, name, file, says in cases:
        tok = Tokenizer.load(model)
        tok.encode("a tokenizer whose template is refused still encodes")
        with pytest.raises(ChatTemplateError) as info:
            tok.apply_chat_template(CHATS[0], template=name)
        assert str(info.value).startswith(f"chat template {model / file}: refused: ") and says in str(info.value)
        assert "\n" not in str(info.value)


def _hub_snapshot(root: Path, tokenizer_json: Path, repo: str = "models--org--tiny") -> Path:
    """A hub-cache layout: snapshots/REV/* are links to ../../blobs/<hash>, as huggingface_hub makes them."""
    blobs, snapshot = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    (snapshot / "additional_chat_templates").mkdir(parents=True)
    blobs.mkdir(parents=True)
    files = {"tokenizer.json": tokenizer_json.read_text(), "tokenizer_config.json": json.dumps(CONFIG),
             "chat_template.jinja": DEFAULT, "additional_chat_templates/trimmed.jinja": TRIMMED}
    for i, (name, text) in enumerate(files.items()):
        (blobs / f"blob{i}").write_text(text)
        (snapshot / name).symlink_to(os.path.relpath(blobs / f"blob{i}", (snapshot / name).parent))
    return snapshot


def test_hub_cache_links_into_their_own_blobs_are_accepted(tmp_path, tokenizer_json):
    snapshot = _hub_snapshot(tmp_path / "hub", tokenizer_json)
    plain = write_model(tmp_path / "plain", tokenizer_json, CONFIG, {"chat_template.jinja": DEFAULT,
                                                                    "additional_chat_templates/trimmed.jinja": TRIMMED})
    hub, ref = Tokenizer.load(snapshot), Tokenizer.load(plain)
    for name in (None, "trimmed"):
        assert hub.apply_chat_template(CHATS[2], template=name) == ref.apply_chat_template(CHATS[2], template=name)
    # a link into another repo's blobs is not the hub's layout
    other = _hub_snapshot(tmp_path / "hub", tokenizer_json, repo="models--org--other")
    (other / "chat_template.jinja").unlink()
    (other / "chat_template.jinja").symlink_to(tmp_path / "hub" / "models--org--tiny" / "blobs" / "blob2")
    with pytest.raises(ChatTemplateError, match="refused: it is a symbolic link"):
        Tokenizer.load(other).apply_chat_template(CHATS[0])
    hub.close()
    ref.close()


# --- the CLI ------------------------------------------------------------------------------------------
def _humaneval_chat(model: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "evalrun", "humaneval", "--no-progress", "--model", str(model), "--chat",
         "--limit", "1", "--max-new-tokens", "1", "--device", "cpu", "--dtype", "float32", "--cache-mode", "fp32",
         "--output-dir", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("case", ["bomb", "symlink"])
def test_cli_ends_with_exit_2_and_one_line(tmp_path, tiny_model_dir, case):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    if case == "bomb":
        (model / "chat_template.jinja").write_text(BOMBS["multiplication"][0])
        says = f"chat template {model / 'chat_template.jinja'}: rendering ran out of its 1 GiB memory bound"
    else:
        (tmp_path / "outside.jinja").write_text(DEFAULT)
        (model / "chat_template.jinja").symlink_to("../outside.jinja")
        says = f"chat template {model / 'chat_template.jinja'}: refused: it is a symbolic link"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = _humaneval_chat(model, tmp_path / "run")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # a bound (it takes ~2.5 s), not a benchmark: on the run's CPU seconds, which other processes'
    # load does not stretch as it does wall-clock seconds (the run's own timeout bounds a hang)
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 10
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("evalrun humaneval: error: ") and says in errors[0], proc.stderr

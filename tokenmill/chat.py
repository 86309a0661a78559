"""The terminal front ends of the offline engine: `tokenmill generate` (one prompt, streamed,
then a summary line) and `tokenmill chat` (a conversation with line editing, history and
local slash-commands)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, TextIO

from tokenmill import envs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (and torch) load only for offline use, not for --url
    from tokenmill.api.reasoning import ReasoningStream
    from tokenmill.engine.llm_engine import LLMEngine

HELP = """commands (never sent to the model):
  /help           this list
  /reset          forget the conversation (the system message stays)
  /system TEXT    set the system message (and forget the conversation)
  /exit           quit (or Ctrl-D)"""
# Shown after an answer that stopped because it reached max_tokens.
CUT_MARK = "[cut at max_tokens: --max-tokens N for longer answers]"


@dataclass
class Answer:
    """One streamed answer: its text, token counts, why it ended and how long it took."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None

    def summary(self) -> str:
        """``N tokens, X tokens/s, TTFT Y s`` (decode speed after the first token)."""
        rate = ""
        if self.first_token_seconds is not None and self.output_tokens > 1:
            decode = self.seconds - self.first_token_seconds
            if decode > 0:
                rate = f", {(self.output_tokens - 1) / decode:.1f} tokens/s"
        ttft = (f", first token after {self.first_token_seconds:.2f} s"
                if self.first_token_seconds is not None else "")
        return f"{self.output_tokens} tokens{rate}{ttft}"


@dataclass
class AnswerWriter:
    """Writes an answer as it comes: a reasoning model's thinking dimmed (on a terminal) and
    apart, after "(thinking)", then the answer itself."""

    out: TextIO
    thinking: bool = False  # the thinking is being written

    def write(self, thought: str, text: str) -> None:
        """The next piece of thinking and of answer (either may be "")."""
        tty = self.out.isatty()
        if thought:
            if not self.thinking:
                self.out.write("\x1b[2m(thinking) " if tty else "(thinking) ")
                self.thinking = True
            self.out.write(thought)
        if text and self.thinking:
            self.out.write("\x1b[0m\n\n" if tty else "\n\n")
            self.thinking = False
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        """End an answer that ended inside its thinking."""
        if self.thinking:
            self.out.write("\x1b[0m\n" if self.out.isatty() else "\n")
            self.thinking = False


def stream_answer(engine: LLMEngine, prompt: str | dict, params: SamplingParams,
                  out: TextIO, thinking: ReasoningStream | None = None) -> Answer:
    """Run one request, writing its text to ``out`` as it comes; what it was. ``thinking``:
    the reader that splits a reasoning model's thinking from its answer (the answer's text
    then holds the answer alone)."""
    from tokenmill.engine.output_processor import OutputKind

    rid = f"cli-{time.monotonic_ns()}"
    answer = Answer()
    writer = AnswerWriter(out)

    def show(thought: str, text: str) -> None:
        if text:
            answer.text.append(text)
        writer.write(thought, text)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, kind=OutputKind.DELTA)
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                c = o.outputs[0]
                answer.prompt_tokens = len(o.prompt_token_ids)
                if c.token_ids and answer.first_token_seconds is None:
                    answer.first_token_seconds = time.perf_counter() - start
                answer.output_tokens += len(c.token_ids)
                if c.text:
                    show(*(thinking.feed(c.text) if thinking is not None else ("", c.text)))
                if o.finished:
                    answer.finish_reason = c.finish_reason
        if thinking is not None:
            show(*thinking.finish())
        writer.close()
    finally:
        engine.abort_request(rid)  # no-op when finished; frees the request on Ctrl-C
        answer.seconds = time.perf_counter() - start
    return answer


def run_generate(engine: LLMEngine, prompt: str, params: SamplingParams) -> int:
    """`tokenmill generate`: the answer on stdout, a summary on stderr."""
    answer = stream_answer(engine, prompt, params, sys.stdout)
    sys.stdout.write("\n")
    if answer.finish_reason == "length":
        print(CUT_MARK, file=sys.stderr)
    print(f"1 request: {answer.prompt_tokens} prompt + {answer.summary()}, "
          f"{answer.seconds:.2f} s in all", file=sys.stderr)
    return 0


def history_file() -> str:
    """Where the chat's input history is kept ($XDG_CACHE_HOME or ~/.cache)."""
    return os.path.join(envs.XDG_CACHE_HOME, "tokenmill", "chat_history")


def _enable_line_editing() -> None:
    """Arrow keys, editing and a history kept between sessions, where readline exists and
    the input is a terminal."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:  # not on every platform: plain input() still works
        return
    import atexit

    path = history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    atexit.register(save)


class ChatBackend(Protocol):
    """Who answers a chat: the offline engine (EngineChat) or a server (chat_remote)."""

    def answer(self, messages: list[dict]) -> Answer:
        """Answer the conversation, streaming the text to stdout; ValueError if refused."""
        ...


class EngineChat:
    """ChatSession's backend on the offline engine: the chat template, then the engine."""

    def __init__(self, engine: LLMEngine, params: SamplingParams) -> None:
        self.engine = engine
        self.params = params

    def answer(self, messages: list[dict]) -> Answer:
        from tokenmill.api.reasoning import resolve_reasoning_parser

        tokenizer = self.engine.tokenizer
        text, ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        # A reasoning model's thinking is shown apart and kept out of the conversation, as
        # the server's reasoning_content is by `tokenmill chat --url`.
        parser = resolve_reasoning_parser("auto", tokenizer.chat_template)
        params, thinking = self.params, None
        if parser is not None:
            thinking = parser.stream(parser.starts_inside(text))
            if parser.special_markup:  # gpt-oss: the parser takes the markers out
                params = replace(params, skip_special_tokens=False)
        return stream_answer(self.engine, {"prompt": text, "prompt_token_ids": ids},
                             params, sys.stdout, thinking)


class ChatSession:
    """A conversation; lines starting with '/' are commands for the session."""

    def __init__(self, backend: ChatBackend, system: str | None) -> None:
        self.backend = backend
        self.system = system
        self.history: list[dict] = []

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def command(self, line: str) -> bool:
        """Run a slash-command; False when the session should end."""
        name, _, rest = line.strip().partition(" ")
        if name == "/exit":
            return False
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            self.history = []
            print("(conversation cleared)", file=sys.stderr)
        elif name == "/system":
            self.system = rest.strip() or None
            self.history = []
            print("(system message " + ("set" if self.system else "removed")
                  + "; conversation cleared)", file=sys.stderr)
        else:
            print(f"unknown command {name}: /help lists them (to send a message that starts "
                  "with '/', begin it with a space)", file=sys.stderr)
        return True

    def say(self, line: str) -> None:
        """Send one user message and stream the answer."""
        self.history.append({"role": "user", "content": line})
        try:
            answer = self.backend.answer(self.messages())
        except ValueError as e:  # e.g. the history outgrew the context
            self.history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            return
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            self.history.pop()
            return
        sys.stdout.write("\n")
        sys.stdout.flush()
        self.history.append({"role": "assistant", "content": "".join(answer.text)})
        if answer.finish_reason == "length":
            print(CUT_MARK, file=sys.stderr)
        print(f"({answer.summary()})", file=sys.stderr)

    def run(self) -> int:
        _enable_line_editing()
        print("tokenmill chat: type a message; /help lists the commands, /exit or Ctrl-D "
              "quits.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.say(line.strip())


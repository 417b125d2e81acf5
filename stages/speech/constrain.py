"""Grammar-constrained decoding of the thinker's reply, with llguidance.

What a request constrains (:meth:`Constrainer.plan`, on the prepare threads):

* ``tool_choice="required"``: the reply is one or more call blocks, each
  ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`` (blocks separated by ``\\n``) with
  ``N`` a declared function and ``A`` valid against its parameters schema, then the stop token;
* a :class:`~omnirt.stages.types.NamedTool`: exactly one block, of that function;
* ``"none"``: the ``<tool_call>`` token is never drawn (a fixed mask, :class:`FixedMask`);
* ``"auto"``: nothing;
* ``response_format`` (:class:`~omnirt.stages.types.JsonSchemaFormat`): the reply is one JSON
  value valid against the schema, then the stop token (or, with tools and ``"auto"``, that or
  call blocks). With ``"required"`` or a named function the reply is calls, and it is ignored.

The JSON is written the way the chat template renders calls (``json.dumps``' separators, no
other whitespace), as a lark grammar with the schemas inlined as ``%json``, compiled once per
request in ``prepare``; a schema llguidance cannot compile is a
:class:`~omnirt.stages.pipeline.RequestRejected` naming the function.

On the engine thread a :class:`GrammarConstraint` advances its matcher with each drawn token and
writes the next token's bitmask into the slot's host row while the GPU runs the talker.

**Finishing within the budget.** With random weights a walk inside a JSON string may never
close. Each constraint tracks ``need``: the length of its *closing path*, the tokens a
deterministic walk takes from the current state to the end of the grammar, preferring at each
step the first allowed of: the stop (when the grammar may end), inside a string ``"``, outside
one ``</tool_call>``, ``}``, ``]``, ``\\n``, ``,``, ``:``, ``0``, ``"``, else the first token of
the bytes the grammar forces (a property name, a const), else the lowest allowed id (single
bytes come first in byte-level vocabularies). When the tokens left before the budget
(``max_tokens``, less one for the stop) come within :data:`MARGIN` of ``need``, the constraint
forces the closing path one token at a time (a one-token mask), so the reply ends, valid, with
the stop token; where the reply may end (``need`` 0, e.g. after a call) it ends once the tokens
left could not hold a whole new call (the closing path from the start) plus the margin.
``need`` is recomputed every step once the budget is within ``2 * need +`` :data:`WATCH`, and
every :data:`REFRESH` steps before that, so a token that opens a deeper structure is seen in time
unless it adds more than ``MARGIN`` tokens to the path at once (an optional property whose value
is a large object with required fields, chosen right at the edge of the budget: the reply then
ends at its budget with the open block given back as text).
A request whose budget cannot hold the closing path from the start is refused in ``prepare``;
forced calls get at most ``tool_call_budget`` tokens.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..pipeline import RequestRejected
from ..types import GenerationRequest, JsonSchemaFormat, NamedTool, ToolSpec
from .token_masks import ALL, mask_words
from .tool_calls import ToolTags

log = logging.getLogger(__name__)

#: Force the closing path once the tokens left are within this many of its length.
MARGIN = 16
#: Recompute the closing path every step once the tokens left are within ``2 * need + WATCH``...
WATCH = 32
#: ...and every this many steps before that.
REFRESH = 16
#: A closing path longer than this counts as unreachable.
PATH_LIMIT = 2048
#: How calls and answers are written: ``json.dumps``' separators, no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: One-character tokens the closing path prefers, outside a JSON string, in order.
_OUTSIDE = ("}", "]", "\n", ",", ":", "0", '"')


def _error_text(message: str) -> str:
    """llguidance's error on one line, without its position prefix and the grammar excerpt."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"\s*\d+ \|", line):  # the excerpt of the grammar begins
            break
        if line.strip() and set(line.strip()) != {"^"}:
            kept.append(line.strip())
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(kept) or "unknown error")
    # A JSON pointer into the schema, as the schema's "$ref" writes it (not a filesystem path).
    return re.sub(r"\bPointer '/", "Pointer '#/", text)


class JsonScan:
    """Whether the bytes so far end inside a JSON string (the closing path's one piece of
    lexical state; the grammar guarantees the text is JSON, so quotes and escapes suffice)."""

    def __init__(self) -> None:
        self.in_string = False
        self.escape = False

    def copy(self) -> JsonScan:
        other = JsonScan()
        other.in_string, other.escape = self.in_string, self.escape
        return other

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:  # quote
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True


@dataclass
class Vocabulary:
    """What constraints share about the vocabulary (read-only once built)."""

    llg: Any  # llguidance.LLTokenizer
    words: int  # bitmask width (int32 words) over the model's logits
    limit: np.ndarray  # [words] int32: the bits of the tokenizer's tokens (ids < vocab_limit)
    stop_ids: tuple[int, ...]
    close_id: int | None
    singles: dict[str, int]  # one-character tokens

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.llg.decode_bytes([token]))


def _limit_row(words: int, limit: int) -> np.ndarray:
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[:limit] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def _lowest(bits: np.ndarray) -> int | None:
    """The lowest token id whose bit is set, or None."""
    nonzero = np.flatnonzero(bits)
    if not nonzero.size:
        return None
    word = int(nonzero[0])
    value = int(bits[word]) & 0xFFFFFFFF
    return word * 32 + ((value & -value).bit_length() - 1)


def _word_with_bit(token: int) -> np.int32:
    """The int32 word with only ``token``'s bit set."""
    return np.array([1 << (token % 32)], dtype=np.uint32).view(np.int32)[0]


class ReplyConstraint:
    """A request's constraint: the mask of the reply's first token (for the prompt pass). A
    :class:`GrammarConstraint` changes it with each token; a :class:`FixedMask` keeps it."""

    first: torch.Tensor  # [words] int32 (host)


class FixedMask(ReplyConstraint):
    """The same mask for every token (``tool_choice="none"``: no ``<tool_call>``)."""

    def __init__(self, words: int, banned: Collection[int]) -> None:
        row = np.full(words, ALL, dtype=np.int32)
        for token in banned:
            row[token // 32] &= ~_word_with_bit(token)
        self.first = torch.from_numpy(row)


class GrammarConstraint(ReplyConstraint):
    """An llguidance matcher over the reply, with the closing-path budget rule (module doc)."""

    def __init__(self, matcher: Any, vocab: Vocabulary, budget: int) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.scan = JsonScan()
        #: The closing path from the current state (its tokens, then the stop); None: unreachable.
        self.path: list[int] | None = None
        self.stop: int | None = None
        self.stale = True  # the state moved off the path since it was computed
        self.steps_since = 0  # tokens since it was computed
        self._refresh()
        #: The closing path of a whole reply: what one more call costs at least.
        self.fresh = self.need
        if self.need > budget - 1:
            raise RequestRejected(
                f"a token budget of {budget} (max_output_tokens, or what the context leaves) is too "
                f"small for the constrained reply: it needs at least {self.need + 1} tokens"
            )
        self.first = torch.empty(vocab.words, dtype=torch.int32)
        self.fill(self.first, budget - 1)

    @property
    def need(self) -> int:
        """The closing path's length before the stop."""
        return len(self.path) if self.path is not None else PATH_LIMIT

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    def advance(self, token: int) -> None:
        """A drawn token (not the stop)."""
        if not self.matcher.consume_token(token):
            log.warning("constrained reply left its grammar at token %d: %s", token, self.error)
        self.scan.feed(self.vocab.token_bytes(token))
        if self.path and self.path[0] == token and not self.stale:
            del self.path[0]  # on the path: the rest of it is the path from here
        else:
            self.stale = True
        self.steps_since += 1

    def fill(self, row: torch.Tensor, remaining: int) -> None:
        """The next token's mask into ``row`` ([words] int32, contiguous, host); ``remaining``:
        the tokens that may still be drawn before the stop."""
        if self.stale and (remaining <= 2 * self.need + WATCH or self.steps_since >= REFRESH):
            self._refresh()
        view = row.numpy()
        # Where the reply may end, it ends unless the budget holds another whole call.
        ending = self.need == 0 and remaining <= self.fresh + MARGIN
        following = self.path[0] if self.path else self.stop
        if (remaining <= self.need + MARGIN or ending) and following is not None:
            view.fill(0)
            view[following // 32] = _word_with_bit(following)
            return
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        view &= self.vocab.limit

    def _refresh(self) -> None:
        """Walks the closing path from the current state (on a copy of the matcher)."""
        matcher, scan = self.matcher.deep_copy(), self.scan.copy()
        path: list[int] = []
        self.path, self.stop = None, None
        while len(path) < PATH_LIMIT:
            if matcher.is_accepting():
                self.path, self.stop = path, self._stop(matcher)
                break
            token = self._closing_token(matcher, scan)
            if token is None or not matcher.consume_token(token):
                break
            scan.feed(self.vocab.token_bytes(token))
            path.append(token)
        self.stale, self.steps_since = False, 0

    def _stop(self, matcher: Any) -> int | None:
        bits = self._mask(matcher)
        for token in self.vocab.stop_ids:
            if (int(bits[token // 32]) >> (token % 32)) & 1:
                return token
        return None

    def _closing_token(self, matcher: Any, scan: JsonScan) -> int | None:
        singles = self.vocab.singles
        if scan.in_string:
            order = [singles.get('"')]
        else:
            order = [self.vocab.close_id, *(singles.get(c) for c in _OUTSIDE)]
        for token in order:
            if token is not None and matcher.validate_tokens([token]) == 1:
                return token
        forced = matcher.compute_ff_tokens()  # bytes the grammar forces (a key, a const): no mask
        if forced and matcher.validate_tokens(forced[:1]) == 1:
            return int(forced[0])
        return _lowest(self._mask(matcher))

    def _mask(self, matcher: Any) -> np.ndarray:
        bits = np.zeros(self.vocab.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return bits & self.vocab.limit


class Constrainer:
    """Compiles requests' constraints for one tokenizer (any thread)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        vocab_limit: int,
        stop_ids: Collection[int],
        tool_call_budget: int = 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.vocab_limit = vocab_limit
        self.words = mask_words(vocab_size)
        self.stop_ids = tuple(sorted(stop_ids))
        self.tags = ToolTags.of(tokenizer)
        self.tool_call_budget = tool_call_budget
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()

    def vocabulary(self) -> Vocabulary:
        """llguidance's view of the tokenizer, built on first use (about a second at 152k)."""
        with self._lock:
            if self._vocab is None:
                self._vocab = self._build_vocabulary()
            return self._vocab

    def _build_vocabulary(self) -> Vocabulary:
        import llguidance.hf

        llg = llguidance.hf.from_tokenizer(
            self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.stop_ids)
        )
        singles = {}
        for char in ('"', *_OUTSIDE):
            ids = self.tokenizer.encode(char, add_special_tokens=False)
            if len(ids) == 1:
                singles[char] = int(ids[0])
        return Vocabulary(
            llg=llg,
            words=self.words,
            limit=_limit_row(self.words, self.vocab_limit),
            stop_ids=self.stop_ids,
            close_id=self.tags.close_id if self.tags else None,
            singles=singles,
        )

    # -- planning -----------------------------------------------------------------------------------
    def plan(self, request: GenerationRequest, budget: int) -> tuple[ReplyConstraint | None, int]:
        """Validates the request's tools, tool choice and response format, and compiles what they
        constrain; returns the constraint (None: unconstrained) and the reply's token budget
        (``budget`` capped for forced calls)."""
        names = self._check_tools(request.tools)
        choice = request.tool_choice
        forced = choice == "required" or isinstance(choice, NamedTool)
        if isinstance(choice, NamedTool):
            if choice.name not in names:
                raise RequestRejected(
                    f"tool_choice names the function {choice.name!r}, which is not among the tools"
                    + (f" ({', '.join(names)})" if names else "")
                )
        elif choice == "required":
            if not names:
                raise RequestRejected("tool_choice 'required' needs at least one tool")
        elif choice not in ("auto", "none"):
            raise RequestRejected(f"unknown tool_choice {choice!r}")
        if names and self.tags is None and choice != "none":
            if forced:
                raise RequestRejected("this model's tokenizer has no <tool_call> token: it cannot call tools")
            log.warning("the tokenizer has no <tool_call> token: tool calls will not be parsed")
        fmt = request.response_format
        if fmt is not None and not isinstance(fmt, JsonSchemaFormat):
            raise RequestRejected(f"unsupported response_format {type(fmt).__name__}")
        if forced:
            wanted = [t for t in request.tools if choice == "required" or t.name == choice.name]
            budget = min(budget, self.tool_call_budget)
            lark = self._calls_grammar(wanted, several=choice == "required")
        elif fmt is not None:
            answer = f"answer: %json {json.dumps(self._answer_schema(fmt.schema))}"
            if names and choice == "auto" and self.tags is not None:
                lark = f"start: answer | calls\n{answer}\n" + self._calls_rules(request.tools, several=True)
            else:
                lark = f"start: answer\n{answer}\n"
        elif choice == "none" and names and self.tags is not None:
            return FixedMask(self.words, [self.tags.open_id]), budget
        else:
            return None, budget
        return self.compile(lark, budget), budget

    def _check_tools(self, tools: Sequence[ToolSpec]) -> list[str]:
        names: list[str] = []
        for tool in tools:
            if not isinstance(tool, ToolSpec):
                raise RequestRejected(f"tools must be ToolSpecs, got {type(tool).__name__}")
            if not isinstance(tool.name, str) or not tool.name:
                raise RequestRejected("every tool needs a non-empty name")
            if tool.name in names:
                raise RequestRejected(f"the function {tool.name!r} is declared twice")
            if not isinstance(tool.parameters, dict):
                raise RequestRejected(
                    f"the parameters of function {tool.name!r} must be a JSON schema object"
                )
            names.append(tool.name)
        return names

    # -- grammars -----------------------------------------------------------------------------------
    def _calls_grammar(self, tools: Sequence[ToolSpec], *, several: bool) -> str:
        return "start: calls\n" + self._calls_rules(tools, several=several)

    def _calls_rules(self, tools: Sequence[ToolSpec], *, several: bool) -> str:
        assert self.tags is not None
        lines = [
            'calls: call ("\\n" call)*' if several else "calls: call",
            f'call: <[{self.tags.open_id}]> "\\n" body "\\n" <[{self.tags.close_id}]>',
            "body: " + " | ".join(f"fn{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            schema = self._call_schema(tool)
            self._check_schema(schema, f"the parameters schema of function {tool.name!r}")
            lines.append(f"fn{i}: %json {json.dumps(schema)}")
        return "\n".join(lines) + "\n"

    def _call_schema(self, tool: ToolSpec) -> dict[str, Any]:
        """``{"name": <const>, "arguments": <parameters>}`` as one schema; the parameters'
        ``$defs`` move to its root, where their ``#/$defs/...`` references point."""
        params = dict(tool.parameters)
        hoisted = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
        params.pop("$schema", None)
        kind = params.setdefault("type", "object")
        if isinstance(kind, list) and "object" in kind:  # e.g. ["object", "null"]: an object here
            kind = params["type"] = "object"
        if kind != "object":
            raise RequestRejected(
                f"the parameters schema of function {tool.name!r} must describe an object, not {kind!r}"
            )
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            **hoisted,
            "x-guidance": JSON_STYLE,
        }

    def _answer_schema(self, schema: Any) -> dict[str, Any]:
        if not isinstance(schema, dict):
            raise RequestRejected("response_format's schema must be a JSON schema object")
        out = {**schema, "x-guidance": JSON_STYLE}
        self._check_schema(out, "the response_format schema")
        return out

    def _check_schema(self, schema: dict[str, Any], what: str) -> None:
        import llguidance

        try:
            lark = f"start: %json {json.dumps(schema)}"
        except (TypeError, ValueError) as exc:
            raise RequestRejected(f"{what} is not JSON: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
        if error and not error.startswith("WARNING"):
            raise RequestRejected(f"{what} cannot be used: {_error_text(error)}")

    def compile(self, lark: str, budget: int) -> GrammarConstraint:
        """A constraint to the lark grammar ``lark`` (llguidance's syntax; tokens as ``<[id]>``)
        for a reply of at most ``budget`` tokens."""
        import llguidance

        vocab = self.vocabulary()
        matcher = llguidance.LLMatcher(vocab.llg, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            error = _error_text(matcher.get_error())
            raise RequestRejected(f"the constrained reply's grammar cannot be compiled: {error}")
        return GrammarConstraint(matcher, vocab, budget)

"""Parsing DeepSeek-V4's (and V4.1's) output back into reasoning_content, content and tool_calls,
piece by piece as it streams (the formats themselves: deepseek_v4.py, deepseek_v41.py)."""

from __future__ import annotations

from deepinfer.entrypoints.chat import dsml
from deepinfer.entrypoints.chat.base import ChatDelta, OutputParser

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

# parser states
REASONING, CONTENT, CALLS = range(3)


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DeepseekV4Parser(OutputParser):
    """Reasoning until `</think>`, then content until a DSML block of tool calls (when the
    request has tools). A marker split across pieces is held back until it is decided, and the
    blank line before a block belongs to the block, so whitespace at the end of content waits
    too. A call is emitted once its `</invoke>` arrives. A block that is not well formed, or
    never closes, is given back as content: nothing the model wrote is lost."""

    def __init__(self, reasoning: bool, tools: bool, dialect: dsml.Dialect = dsml.V4):
        self.dsml = dialect  # the family's DSML tag names
        self.state = REASONING if reasoning else CONTENT
        self.tools = tools
        self.buf = ""  # REASONING/CONTENT: text not yet emitted
        self.block = ""  # CALLS: the raw block from its opening marker
        self.gap = ""  # CALLS: the whitespace before the marker (given back with the block, if it is)
        self.parsed = 0  # CALLS: end of the calls emitted so far within `block`

    def feed(self, text: str) -> ChatDelta:
        out = ChatDelta()
        if self.state == CALLS:
            self.block += text
        else:
            self.buf += text
        while self._advance(out):
            pass
        return out

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self.state == REASONING:  # the budget ended inside the reasoning
            out.reasoning_content = self.buf
        elif self.state == CONTENT:
            out.content = self.buf
        else:  # the block never closed
            out.content = self._unparsed()
        self.buf, self.block, self.parsed = "", "", 0
        return out

    def _unparsed(self) -> str:
        return (self.gap if not self.parsed else "") + self.block[self.parsed:]

    def _advance(self, out: ChatDelta) -> bool:
        """One step of the state machine; True when it should run again."""
        if self.state == REASONING:
            at = self.buf.find(END_THINK)
            if at >= 0:
                out.reasoning_content += self.buf[:at]
                self.buf, self.state = self.buf[at + len(END_THINK):], CONTENT
                return True
            cut = len(self.buf) - _held(self.buf, END_THINK)
            out.reasoning_content += self.buf[:cut]
            self.buf = self.buf[cut:]
            return False
        if self.state == CONTENT:
            if not self.tools:
                out.content += self.buf
                self.buf = ""
                return False
            at = self.buf.find(self.dsml.CALLS_OPEN)
            if at >= 0:
                content = self.buf[:at].rstrip()
                out.content += content
                self.gap, self.block, self.parsed, self.buf = self.buf[len(content):at], self.buf[at:], 0, ""
                self.state = CALLS
                return True
            cut = len(self.buf[:len(self.buf) - _held(self.buf, self.dsml.CALLS_OPEN)].rstrip())
            out.content += self.buf[:cut]
            self.buf = self.buf[cut:]
            return False
        return self._advance_calls(out)

    def _advance_calls(self, out: ChatDelta) -> bool:
        start = self.parsed or len(self.dsml.CALLS_OPEN)
        rest = self.block[start:].lstrip()
        at = len(self.block) - len(rest)
        if rest.startswith(self.dsml.INVOKE_HEAD):
            end = self.block.find(self.dsml.INVOKE_CLOSE, at)
            if end < 0:
                return False  # the call is still being written
            call = self.dsml.parse_invoke(self.block[at:end + len(self.dsml.INVOKE_CLOSE)])
            if call is None:
                return self._give_back()
            out.tool_calls.append(call)
            self.parsed = end + len(self.dsml.INVOKE_CLOSE)
            return True
        if rest.startswith(self.dsml.CALLS_CLOSE):  # the block is done; what follows is content again
            self.buf = rest[len(self.dsml.CALLS_CLOSE):]
            self.block, self.parsed, self.state = "", 0, CONTENT
            return True
        if not rest or self.dsml.INVOKE_HEAD.startswith(rest) or self.dsml.CALLS_CLOSE.startswith(rest):
            return False  # a marker still arriving
        return self._give_back()

    def _give_back(self) -> bool:
        """Not DSML after all: the unparsed text is content, and no block is looked for again."""
        self.buf = self._unparsed()
        self.block, self.parsed, self.state, self.tools = "", 0, CONTENT, False
        return True

"""README.md's shell blocks as runnable commands, for the test that runs them as printed.

A block is a fenced ```sh block (indented ones too). Its commands run in one bash, in
order, so a variable set on one line is there for the next. A command is expected to
exit 0, unless a comment names the gRPC status it ends with:
- `# ERROR: Code: InvalidArgument` under a command (grpcurl's own output, as README
  shows it) belongs to the command above;
- any other comment belongs to the command below (`# does not fit: RESOURCE_EXHAUSTED ...`).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# grpc's names both ways: RESOURCE_EXHAUSTED as the docs write it, ResourceExhausted as
# grpcurl prints it.
_CAMEL = {
    code.name: "".join(part.capitalize() for part in code.name.split("_"))
    for code in grpc.StatusCode
}
_CODE_WORDS = re.compile(r"\b(" + "|".join(n for n in _CAMEL if n != "OK") + r")\b")
_GRPCURL_CODE = re.compile(r"Code: (\w+)")
MARKER = "@@readme-command"


@dataclass
class Command:
    line: int  # README line of its first line
    text: str
    expected_code: str | None = None  # grpcurl's spelling (ResourceExhausted), or None


@dataclass
class ShellBlock:
    line: int  # README line of the opening fence
    text: str
    commands: list[Command] = field(default_factory=list)

    @property
    def first_word(self) -> str:
        return self.commands[0].text.split()[0] if self.commands else ""


def shell_blocks(path: Path) -> list[ShellBlock]:
    blocks, lines = [], path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = re.match(r"^(\s*)```sh\s*$", lines[index])
        if not fence:
            index += 1
            continue
        indent, start, body = len(fence.group(1)), index + 1, []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index][indent:])
            index += 1
        block = ShellBlock(start, "\n".join(body))
        block.commands = _commands(body, first_line=start + 1)
        blocks.append(block)
        index += 1
    return blocks


def _commands(lines: list[str], first_line: int) -> list[Command]:
    commands: list[Command] = []
    pending_code: str | None = None  # named by a comment above the next command
    current: Command | None = None
    for offset, raw in enumerate(lines):
        stripped = raw.strip()
        if current is not None:  # a continuation of the command above
            current.text += "\n" + raw
            if _complete(current.text):
                current = None
            continue
        if not stripped:
            continue
        if stripped.startswith("#"):
            found = _GRPCURL_CODE.search(stripped)
            if stripped.startswith("# ERROR:") and commands:
                if found:
                    commands[-1].expected_code = found.group(1)
            elif word := _CODE_WORDS.search(stripped):
                pending_code = _CAMEL[word.group(1)]
            continue
        command = Command(first_line + offset, raw, pending_code)
        pending_code = None
        commands.append(command)
        if not _complete(raw):
            current = command
    return commands


def _complete(text: str) -> bool:
    """Whether `text` is a whole command: no trailing backslash, no quote left open."""
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text)
    except ValueError:  # "No closing quotation": a quoted argument goes on below
        return False
    return True


@dataclass
class Outcome:
    command: Command
    returncode: int
    output: str

    @property
    def failure(self) -> str | None:
        """Why this run breaks README's promise, or None."""
        expected = self.command.expected_code
        if expected is None:
            if self.returncode != 0:
                return f"exited {self.returncode}"
            return None
        if self.returncode == 0:
            return f"succeeded, README says it ends with {expected}"
        if f"Code: {expected}" not in self.output:
            return f"exited {self.returncode} without Code: {expected}"
        return None

    def describe(self) -> str:
        return f"README.md:{self.command.line}: {self.command.text}\n{self.output[-1500:]}"


def run_block(block: ShellBlock, *, cwd: Path, env: dict, timeout_s: float) -> list[Outcome]:
    """Runs the block's commands in one bash; each one's exit status and output."""
    script = ["exec 2>&1"]  # grpcurl's errors in order with what each command printed
    for index, command in enumerate(block.commands):
        script.append(command.text)
        script.append(f'echo "{MARKER} {index} $?"')
    ran = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    outcomes, chunk = [], []
    for line in ran.stdout.splitlines():
        if line.startswith(MARKER):
            _, index, code = line.split()
            outcomes.append(Outcome(block.commands[int(index)], int(code), "\n".join(chunk)))
            chunk = []
        else:
            chunk.append(line)
    missing = block.commands[len(outcomes) :]
    outcomes += [Outcome(c, -1, "never ran: " + "\n".join(chunk)[-500:]) for c in missing]
    return outcomes

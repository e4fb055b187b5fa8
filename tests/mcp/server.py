"""An MCP server for Idem's tests: the official SDK's FastMCP over Streamable HTTP, on a free
port that it prints as `PORT <n>`. Every tool call appends one line to the ledger file named
on the command line, so the test counts side effects.

Tools:
- create_payment  a side effect, not annotated (recorded, never re-sent); `delay` makes it slow
- get_balance     readOnlyHint: passed through unrecorded
- set_flag        idempotentHint: recorded, replay-safe
- export_report   a side effect that reports progress on its answer's event stream
- crash_midway    the server process dies in the middle of the call
- add_report_tool registers `late_report` (read-only) and announces tools/list_changed
- whoami          read-only: the Mcp-Session-Id the server saw
"""

import asyncio
import os
import socket
import sys
from typing import TypedDict

import uvicorn
from mcp.server.fastmcp import Context, FastMCP
from mcp.types import ToolAnnotations

LEDGER = sys.argv[1]

server = FastMCP("idem-test-tools", log_level="WARNING")


class Payment(TypedDict):
    payment: str
    amount: int
    currency: str


class Balance(TypedDict):
    balance: int


def effect(line: str) -> None:
    with open(LEDGER, "a") as ledger:
        ledger.write(line + "\n")


@server.tool()
async def create_payment(amount: int, currency: str = "EUR", delay: float = 0.0) -> Payment:
    """Creates a payment: the side effect that must happen once."""
    if delay:
        await asyncio.sleep(delay)
    effect(f"create_payment {amount} {currency}")
    with open(LEDGER) as ledger:
        number = sum(1 for _ in ledger)
    return {"payment": f"pay_{number}", "amount": amount, "currency": currency}


@server.tool()
async def export_report(steps: int, ctx: Context) -> str:
    """A slow side effect that reports its progress as it goes."""
    for step in range(steps):
        await ctx.report_progress(step + 1, steps)
        await asyncio.sleep(0.05)
    effect(f"export_report {steps}")
    return f"exported in {steps} steps"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def get_balance() -> Balance:
    """Reads the balance: changes nothing."""
    effect("get_balance")
    return {"balance": 100}


@server.tool(annotations=ToolAnnotations(idempotentHint=True))
async def set_flag(name: str, value: bool) -> str:
    """Sets a flag: calling it twice changes nothing more."""
    effect(f"set_flag {name} {value}")
    return f"{name}={value}"


@server.tool()
async def crash_midway(amount: int, ctx: Context) -> str:
    """Takes effect, logs to the client (its answer's stream has begun), then the server dies."""
    effect(f"crash_midway {amount}")
    await ctx.info("debited; confirming")
    await asyncio.sleep(0.2)
    os._exit(1)


async def late_report() -> str:
    effect("late_report")
    return "report"


@server.tool()
async def add_report_tool(ctx: Context) -> str:
    """Adds a read-only tool and tells the client the list changed."""
    effect("add_report_tool")
    server.add_tool(late_report, annotations=ToolAnnotations(readOnlyHint=True))
    await ctx.session.send_tool_list_changed()
    return "added"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def whoami(ctx: Context) -> str:
    """The session id this server saw on the request."""
    request = ctx.request_context.request
    return request.headers.get("mcp-session-id", "") if request is not None else ""


def main() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()

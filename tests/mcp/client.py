"""The official MCP Python SDK's client, unmodified, pointed at Idem: one scenario per run,
its findings printed as one JSON line (two for `unknown`, which waits between them for the
test to settle the record).

    client.py <url> <scenario> [<flag file>]

The key travels in params._meta["io.idem/idempotencyKey"] (call_tool's `meta=`), or in
params.idempotencyKey (SEP-3182) through the session's raw send_request.
"""

import asyncio
import json
import os
import sys
from datetime import timedelta

import mcp.types as types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError

URL, SCENARIO = sys.argv[1], sys.argv[2]
META = "io.idem/idempotencyKey"


def out(value) -> None:
    print(json.dumps(value), flush=True)


def shown(result: types.CallToolResult) -> dict:
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


def failed(error: McpError) -> dict:
    return {"code": error.error.code, "message": error.error.message, "data": error.error.data}


async def call(session, tool, arguments, key, timeout=10.0, progress=None):
    try:
        result = await session.call_tool(
            tool,
            arguments,
            read_timeout_seconds=timedelta(seconds=timeout),
            meta={META: key} if key else None,
            progress_callback=progress,
        )
        return {"result": shown(result)}
    except McpError as error:
        return {"error": failed(error)}


async def call_with_param_key(session, tool, arguments, key):
    """params.idempotencyKey, as SEP-3182 names it: the SDK's params model takes extra fields."""
    params = types.CallToolRequestParams(name=tool, arguments=arguments, idempotencyKey=key)
    request = types.ClientRequest(types.CallToolRequest(params=params))
    try:
        return {"result": shown(await session.send_request(request, types.CallToolResult))}
    except McpError as error:
        return {"error": failed(error)}


async def lost_answer(session, _):
    arguments = {"amount": 10, "delay": 1.5}
    first = await call(session, "create_payment", arguments, "lost-1", timeout=0.3)
    retry = await call(session, "create_payment", arguments, "lost-1")
    by_param = await call_with_param_key(session, "create_payment", arguments, "lost-1")
    steps = []

    async def progressed(progress, total, message):
        steps.append(progress)

    export = await call(session, "export_report", {"steps": 3}, "export-1", progress=progressed)
    export_again = await call(session, "export_report", {"steps": 3}, "export-1")
    out({"first": first, "retry": retry, "by_param": by_param, "export": export, "export_again": export_again,
         "progress": steps})


async def concurrent(session, _):
    arguments = {"amount": 20, "delay": 0.5}
    calls = [call(session, "create_payment", arguments, "dup-1") for _ in range(20)]
    out({"results": await asyncio.gather(*calls)})


async def mismatch(session, _):
    first = await call(session, "create_payment", {"amount": 30}, "mm-1")
    other = await call(session, "create_payment", {"amount": 31}, "mm-1")
    other_tool = await call(session, "set_flag", {"name": "x", "value": True}, "mm-1")
    out({"first": first, "other": other, "other_tool": other_tool})


async def unknown(session, flag):
    # The SDK checks a result against its tool's output schema, listing the tools when it has
    # not yet: listed now, while the server is alive.
    await session.list_tools()
    first = await call(session, "crash_midway", {"amount": 40}, "crash-1", timeout=5)
    retry = await call(session, "crash_midway", {"amount": 40}, "crash-1")
    out({"first": first, "retry": retry})
    while not os.path.exists(flag):
        await asyncio.sleep(0.05)
    out({"settled": await call(session, "crash_midway", {"amount": 40}, "crash-1")})


async def read_only(session, _):
    await session.list_tools()
    plain = [await call(session, "get_balance", {}, None) for _ in range(2)]
    keyed = await call(session, "get_balance", {}, "ro-1")
    flag = await call(session, "set_flag", {"name": "dark_mode", "value": True}, "flag-1")
    flag_again = await call(session, "set_flag", {"name": "dark_mode", "value": True}, "flag-1")
    out({"plain": plain, "keyed": keyed, "flag": flag, "flag_again": flag_again})


async def session_and_list_changed(session, _, init, session_id, changed):
    await session.list_tools()
    seen = await call(session, "whoami", {}, None)
    added = await call(session, "add_report_tool", {}, "add-1")
    try:
        await asyncio.wait_for(changed.wait(), 10)
        notified = True
    except asyncio.TimeoutError:
        notified = False
    tools = [tool.name for tool in (await session.list_tools()).tools]
    report = await call(session, "late_report", {}, None)
    out({
        "capabilities": init.capabilities.model_dump(mode="json", by_alias=True, exclude_none=True),
        "client_session": session_id(),
        "server_saw": seen,
        "added": added,
        "notified": notified,
        "tools": tools,
        "report": report,
    })


async def main():
    changed = asyncio.Event()

    async def on_message(message):
        if isinstance(message, types.ServerNotification) and isinstance(message.root, types.ToolListChangedNotification):
            changed.set()

    async with streamablehttp_client(URL) as (read, write, session_id):
        async with ClientSession(read, write, message_handler=on_message) as session:
            init = await session.initialize()
            flag = sys.argv[3] if len(sys.argv) > 3 else None
            if SCENARIO == "session_and_list_changed":
                await session_and_list_changed(session, flag, init, session_id, changed)
            else:
                await globals()[SCENARIO](session, flag)


asyncio.run(main())

"""The MCP Python SDK (`pip install mcp`, 2.3: protocol 2026-07-28) against
the mcp_payments example: lists the tools, then calls create_charge twice
with one key in `_meta`. Prints what it got as one JSON line.

Usage: python_client.py URL ACCOUNT KEY
"""

import asyncio
import json
import sys

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def main(url: str, account: str, key: str) -> None:
    headers = {"authorization": f"Bearer {account}"}
    async with httpx2.AsyncClient(headers=headers) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            read, write = streams[0], streams[1]
            async with ClientSession(read, write) as session:
                await session.discover()
                tools = await session.list_tools()
                calls = []
                for _ in range(2):
                    result = await session.call_tool(
                        "create_charge",
                        {"amount": 700, "currency": "usd"},
                        meta={"idempotency-key": key},
                    )
                    calls.append(
                        {"isError": result.is_error, "structuredContent": result.structured_content}
                    )
    print(json.dumps({"tools": sorted(t.name for t in tools.tools), "calls": calls}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))

"""`store_failures_noticed`: a handler of the chat app whose chat database fails (the disk full, the file locked by
another program, read-only or damaged) shows the store's one line and the app runs on, instead of Textual's crash
screen, which would also take away what is on screen and in the input."""
from __future__ import annotations

import functools
import inspect

from ..chats import ChatStoreError


def store_failures_noticed(handler):
    """`handler` (a method of a Textual app or widget, sync or async) with ChatStoreError made a notice."""

    def notice(node, err: ChatStoreError) -> None:
        node.app.notify(str(err), severity="error", timeout=15)

    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def guarded_async(self, *args, **kwargs):
            try:
                return await handler(self, *args, **kwargs)
            except ChatStoreError as err:
                notice(self, err)
                return None

        return guarded_async

    @functools.wraps(handler)
    def guarded(self, *args, **kwargs):
        try:
            return handler(self, *args, **kwargs)
        except ChatStoreError as err:
            notice(self, err)
            return None

    return guarded

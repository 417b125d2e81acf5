"""The ordered list of conversation items, with lookup by id and placement after an item."""

from __future__ import annotations

from collections.abc import Iterator

from .errors import ErrorCode, SessionError
from .items import Item, item_bytes

#: ``previous_item_id`` that places an item at the very beginning.
ROOT = "root"


class Conversation:
    def __init__(self, conversation_id: str) -> None:
        self.id = conversation_id
        self._items: list[Item] = []

    def __iter__(self) -> Iterator[Item]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: str) -> bool:
        return any(i.id == item_id for i in self._items)

    @property
    def bytes_held(self) -> int:
        """What the items hold (:func:`~.items.item_bytes`), computed now (reply audio grows and
        truncation shrinks items after they are added)."""
        return sum(item_bytes(i) for i in self._items)

    @property
    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def find(self, item_id: str) -> Item | None:
        for item in self._items:
            if item.id == item_id:
                return item
        return None

    def get(self, item_id: str, code: ErrorCode, action: str = "finding", param: str = "item_id") -> Item:
        """The item; a missing one is a :class:`SessionError` with ``code`` (OpenAI names the code
        after the request: ``item_retrieve_invalid_item_id``, ``item_delete_invalid_item_id``, ...)."""
        item = self.find(item_id)
        if item is None:
            raise SessionError(
                code, f"Error {action} item: the item with id '{item_id}' does not exist.", param
            )
        return item

    def previous_id(self, item_id: str) -> str | None:
        for i, item in enumerate(self._items):
            if item.id == item_id:
                return self._items[i - 1].id if i else None
        return None

    def check_insert(self, item_id: str, previous_item_id: str | None) -> None:
        """Raises unless ``insert`` would succeed (so callers can validate before side effects)."""
        if item_id in self:
            raise SessionError(
                ErrorCode.ITEM_CREATE_DUPLICATE_ID,
                f"Error adding item: an item with id '{item_id}' already exists.",
                "item.id",
            )
        if previous_item_id not in (None, ROOT) and previous_item_id not in self:
            raise SessionError(
                ErrorCode.ITEM_CREATE_INVALID_PREVIOUS_ID,
                f"Error adding item: the previous item with id '{previous_item_id}' does not exist.",
                "previous_item_id",
            )

    def insert(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Add ``item`` after ``previous_item_id`` (``None``: at the end; ``"root"``: first).

        Returns the id of the item now before it.
        """
        self.check_insert(item.id, previous_item_id)
        if previous_item_id is None:
            before = self.last_id
            self._items.append(item)
        elif previous_item_id == ROOT:
            before = None
            self._items.insert(0, item)
        else:
            index = next(i for i, it in enumerate(self._items) if it.id == previous_item_id)
            before = previous_item_id
            self._items.insert(index + 1, item)
        return before

    def delete(self, item_id: str) -> Item:
        item = self.get(item_id, ErrorCode.ITEM_DELETE_INVALID_ID, "deleting")
        self._items.remove(item)
        return item

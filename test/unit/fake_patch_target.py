"""A target and a patch module for the framework's own tests (not upstream code)."""

from __future__ import annotations


class Greeter:
    def hello(self, name: str) -> str:
        return f"hello {name}"

    @staticmethod
    def shout(text: str) -> str:
        return text.upper()

    @classmethod
    def make(cls) -> "Greeter":
        return cls()


def applicable() -> str | None:
    return None


def apply(ctx) -> None:
    ctx.around("fake_patch_target:Greeter.hello", lambda orig, self, name: orig(self, name) + "!")
    ctx.after("fake_patch_target:Greeter.shout", lambda result, text: result + "?")
    ctx.around("fake_patch_target:Greeter.make", lambda orig, cls: orig(cls))


REGISTRY: dict[str, str] = {}

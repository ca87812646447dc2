"""A target and a patch module for the framework's own tests (not upstream code)."""

from __future__ import annotations


class Greeter:
    def hello(self, name: str) -> str:
        return f"hello {name}"

    @staticmethod
    def shout(text: str) -> str:
        return text.upper()

    @classmethod
    def make(cls) -> Greeter:
        return cls()


def applicable() -> str | None:
    return None


NESTING: list[str] = []  # patch ids whose hello wrapper ran, innermost first


def apply(ctx) -> None:
    def hello(orig, self, name):
        out = orig(self, name) + "!"
        NESTING.append(ctx.id)
        return out

    ctx.around("fake_patch_target:Greeter.hello", hello)
    ctx.after("fake_patch_target:Greeter.shout", lambda result, text: result + "?")
    ctx.around("fake_patch_target:Greeter.make", lambda orig, cls: orig(cls))


REGISTRY: dict[str, str] = {}

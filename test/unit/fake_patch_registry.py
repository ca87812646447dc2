"""A REGISTRY patch module for the framework's own tests (edits fake_patch_target.REGISTRY)."""

from __future__ import annotations


def apply(ctx) -> None:
    import fake_patch_target

    fake_patch_target.REGISTRY["greeter"] = "fake"
    ctx.on_undo(lambda: fake_patch_target.REGISTRY.pop("greeter", None))

"""`SignedUrls`: an object's signed GET URL is made once and reused until half its life is
gone, made again after a `forget` (its credentials were refused), and the cache never grows
beyond its bound."""

from __future__ import annotations

from asynctron.storage.backends.objects._layout import ObjectUrl
from asynctron.storage.backends.objects._signed_gets import SignedUrls


class _Signer:
    def __init__(self) -> None:
        self.signed: list[str] = []

    async def __call__(self, url: ObjectUrl) -> str:
        self.signed.append(url.key)
        return f"https://store/{url.bucket}/{url.key}?signature={len(self.signed)}"


async def test_a_url_is_signed_once_until_half_its_life_then_again() -> None:
    now = [100.0]
    signer = _Signer()
    urls = SignedUrls(signer, life_s=60, clock=lambda: now[0])
    a = ObjectUrl("s3", "b", "a")
    first = await urls.get(a)
    now[0] += 30
    assert await urls.get(a) == first and signer.signed == ["a"]
    now[0] += 0.5
    second = await urls.get(a)
    assert second != first and signer.signed == ["a", "a"]
    assert await urls.get(a) == second


async def test_forget_signs_again_and_the_cache_stays_bounded() -> None:
    signer = _Signer()
    urls = SignedUrls(signer, life_s=3600, most=3)
    a, b = ObjectUrl("az", "c", "a"), ObjectUrl("az", "c", "b")
    first = await urls.get(a)
    urls.forget(a)
    urls.forget(b)  # never signed: nothing to forget
    assert await urls.get(a) != first
    for key in "bcd":
        await urls.get(ObjectUrl("az", "c", key))
    assert len(urls._made) <= 3
    signed = len(signer.signed)
    await urls.get(ObjectUrl("az", "c", "d"))  # the newest is kept
    assert len(signer.signed) == signed

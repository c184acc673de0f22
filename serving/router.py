"""Router: a request's ``model`` → a held device slot (a `Lease`), with in-flight tracking.

    lease = await router.acquire("math")    # UnknownModel, or LoadError from the cache
    ... generate with lease.slot ...
    lease.release()                         # idempotent; once the engine is done with the row

The base model is slot 0 and never loads. For a variant, the registry counts the request in
flight (so ``DELETE`` can wait for it) and the cache brings the variant to a device slot and
holds it until release.
"""

from __future__ import annotations

from serving.cache import DeltaCache
from serving.registry import Registry, Variant, end_request


class UnknownModel(KeyError):
  def __init__(self, model):
    super().__init__(model)
    self.model = model


class Lease:
  __slots__ = ("router", "variant", "slot", "model", "_released", "reqs")

  def __init__(self, router: Router, variant: Variant | None, slot: int, model: str):
    self.router, self.variant, self.slot, self.model = router, variant, slot, model
    self._released = False
    self.reqs: list = []

  def attach(self, reqs: list) -> None:
    """The engine requests generated under this lease: a DELETE of the variant can end them
    (`serving.registry.end_requests`); if one already did, they end at once."""
    self.reqs = list(reqs)
    if self.router.ended_by is not None:  # the server is stopping (`Router.end_all`)
      for r in self.reqs:
        _end(r, *self.router.ended_by)
    v = self.variant
    if v is None:
      return
    v.live.update(self.reqs)
    if v.ended_by is not None:
      for r in self.reqs:
        end_request(r, v.ended_by)

  def release(self) -> None:
    if self._released:
      return
    self._released = True
    self.router.leases.discard(self)
    if self.variant is not None:
      self.variant.live.difference_update(self.reqs)
      self.router.cache.release(self.variant)
      self.router.registry.end(self.variant)
      self.router.metrics.in_flight.labels(self.model).dec()
    else:
      self.router.base_in_flight -= 1
      self.router.metrics.in_flight.labels(self.model).dec()


class Router:
  def __init__(self, registry: Registry, cache: DeltaCache, metrics):
    self.registry, self.cache, self.metrics = registry, cache, metrics
    self.base_requests = 0
    self.base_in_flight = 0
    self.leases: set[Lease] = set()  # held: `end_all` reaches their engine requests
    self.ended_by: tuple[str, str] | None = None  # (reason, code) once `end_all` ran

  def end_all(self, reason: str, code: str) -> int:
    """Ends every engine request of the held leases with an error (``reason``, ``code``):
    the engine frees their rows at its next iteration and each gets its last event; requests
    attached later end at once. Returns how many were in flight."""
    self.ended_by = (reason, code)
    live = [r for lease in self.leases for r in lease.reqs if not r.ended]
    for r in live:
      _end(r, reason, code)
    return len(live)

  @property
  def base_id(self) -> str:
    return self.registry.base_id

  def knows(self, model) -> bool:
    return model == self.base_id or self.registry.get(model) is not None

  async def acquire(self, model: str) -> Lease:
    if model == self.base_id:
      self.base_requests += 1
      self.base_in_flight += 1
      self.metrics.in_flight.labels(model).inc()
      return self._held(Lease(self, None, 0, model))
    v = self.registry.get(model)
    if v is None:
      raise UnknownModel(model)
    self.registry.begin(v)
    self.metrics.in_flight.labels(model).inc()
    try:
      slot = await self.cache.acquire(v)
    except BaseException:
      self.registry.end(v)
      self.metrics.in_flight.labels(model).dec()
      raise
    return self._held(Lease(self, v, slot, model))

  def _held(self, lease: Lease) -> Lease:
    self.leases.add(lease)
    return lease


def _end(r, reason: str, code: str) -> None:
  """Cancels engine request ``r`` so that it ends with an error (``reason``, ``code``)."""
  r.cancel_reason, r.cancel_code = reason, code
  r.cancelled = True

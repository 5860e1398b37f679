"""The Kopf handlers: a thin shell around placement.decide, the Store and the builders.

Importing this package registers them in Kopf's default registry (`registry`: every watch in
one table). Every handler follows the same shape:
  1. outside the lock: parse the object, resolve its model (may call the Hub);
  2. in one `store.books.transaction()`: decide and book or release, update the records (no API
     calls; its only awaits are decisions in the worker threads, bounded in time; an exception
     rolls its ledger change back);
  3. outside the lock: post Events, write the children (Deployments, Service), mark statuses.
Step 2 collects what step 3 must do in `common.Effects`; `writes.finish` does step 3.
"""

from vllmfit.operator.handlers import registry  # noqa: F401  (registers the handlers)
from vllmfit.operator.handlers.startup import configure

__all__ = ["configure"]

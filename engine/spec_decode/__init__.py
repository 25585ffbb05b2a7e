"""Speculative decoding by n-gram prompt lookup (see docs/engine.md "Speculative decoding").

`config` the setting, `ngram` the drafter, `acceptance` the rule that keeps outputs exact,
`rows` the verification rows a step samples, `decoder` the engine-side bookkeeping (drafts
per step, KV rollback, counters). Nothing is imported here, so `engine.config` can read the
setting without pulling in the engine.
"""

"""Registers Switchyard as a database in VectorDBBench 2.0, whose `DB` enum has no plugin mechanism.

Importing this module registers (idempotently): it adds a `DB.Switchyard` member and makes `DB.init_cls`,
`DB.config_cls` and `DB.case_config_cls` answer our classes for it. VectorDBBench runs its work in spawned
processes, which start with a fresh `DB`; every path by which such a process meets Switchyard imports this
module first: the entry module (bench.py) imports it at top level, and so does the client module; a pickled
`DB.Switchyard` unpickles through `switchyard_member` below, which lives here.
"""

from __future__ import annotations

from vectordb_bench.backend.clients import DB

NAME = "Switchyard"


def switchyard_member() -> DB:
    """DB.Switchyard, registering it first: what a pickled DB.Switchyard unpickles through."""
    register()
    return DB[NAME]


def _ours(self: DB) -> bool:
    return self.name == NAME


def _add_member() -> None:
    # What EnumType does for a member declared in the class body (Python 3.11-3.13).
    member = object.__new__(DB)
    member._name_ = NAME
    member._value_ = NAME
    member.__objclass__ = DB
    member._sort_order_ = len(DB._member_names_)
    # Enum pickles a member as DB(value), which a fresh process cannot answer before registering.
    member.__dict__["__reduce_ex__"] = lambda protocol: (switchyard_member, ())
    type.__setattr__(DB, NAME, member)
    DB._member_map_[NAME] = member
    DB._value2member_map_[NAME] = member
    DB._member_names_.append(NAME)


def _dispatch() -> None:
    init_cls, config_cls, case_config_cls = DB.init_cls, DB.config_cls, DB.case_config_cls  # the originals

    def our_init_cls(self: DB) -> type:
        if _ours(self):
            from .client import Switchyard

            return Switchyard
        return init_cls.fget(self)

    def our_config_cls(self: DB) -> type:
        if _ours(self):
            from .config import SwitchyardConfig

            return SwitchyardConfig
        return config_cls.fget(self)

    def our_case_config_cls(self: DB, index_type=None) -> type | None:
        if _ours(self):
            from .config import case_config_cls as ours

            return ours(index_type)
        return case_config_cls(self, index_type)

    type.__setattr__(DB, "init_cls", property(our_init_cls, doc=init_cls.__doc__))
    type.__setattr__(DB, "config_cls", property(our_config_cls, doc=config_cls.__doc__))
    type.__setattr__(DB, "case_config_cls", our_case_config_cls)


def register() -> None:
    if NAME in DB._member_map_:
        return
    _dispatch()
    _add_member()


register()

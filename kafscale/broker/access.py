"""Who may do what on this broker: the authorizer over the ACLs in etcd,
re-read every ACL_REFRESH_S (another broker or `kafscale acls` may change
them), with a hook that passes changes on to the protocol workers."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kafscale.broker.context import RequestContext
from kafscale.config import Config
from kafscale.metadata.store import MetaStore
from kafscale.security.acl import CLUSTER, AclBinding, Authorizer, Operation, ResourceType, authorized_operations

log = logging.getLogger(__name__)

ACL_REFRESH_S = 1.0  # how soon ACLs changed by another broker (or `kafscale acls`) apply here


class Access:
    def __init__(self, cfg: Config, meta: MetaStore) -> None:
        self.meta = meta
        self.authz = Authorizer(cfg.authorizer, cfg.super_users, cfg.allow_everyone_if_no_acl_found)
        # told when the ACLs change (the log process passes them on to its workers)
        self.on_acls: Callable[[list[AclBinding]], None] = lambda acls: None

    @property
    def enabled(self) -> bool:
        return self.authz.enabled

    def allowed(self, hdr: RequestContext, op: Operation, rtype: ResourceType, name: str) -> bool:
        return self.authz.allows(hdr.principal, hdr.client_host, op, rtype, name)

    def may_create_topic(self, hdr: RequestContext, name: str) -> bool:
        return (self.allowed(hdr, Operation.CREATE, ResourceType.CLUSTER, CLUSTER)
                or self.allowed(hdr, Operation.CREATE, ResourceType.TOPIC, name))

    def operations(self, hdr: RequestContext, rtype: ResourceType, name: str) -> int:
        """The authorized_operations bit field of a resource for this principal."""
        return authorized_operations(lambda op: self.allowed(hdr, op, rtype, name), rtype)

    def may_write_some_topic(self, hdr: RequestContext) -> bool:
        return self.authz.allows_any_topic(hdr.principal, hdr.client_host, Operation.WRITE)

    async def refresh(self) -> None:
        acls = await self.meta.list_acls()
        if acls != self.authz.acls:
            self.authz.update(acls)
            self.on_acls(acls)

    async def run(self) -> None:
        """Re-read the ACLs until cancelled; a failed read keeps the last ones."""
        while True:
            await asyncio.sleep(ACL_REFRESH_S)
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("reading ACLs failed (the last ones read still apply): %r", exc)

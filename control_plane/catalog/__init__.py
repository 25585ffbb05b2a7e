"""Provider GPU catalogs (SkyPilot CSV layout) turned into capacity pool offers. Pure:
text in, `PoolOffer`s out; importing them into the database is the admin API's job."""

from control_plane.catalog.parse import (
    CatalogError,
    CatalogReport,
    PoolOffer,
    load_catalog,
    offers_to_pools,
    parse_catalog,
)

__all__ = ["CatalogError", "CatalogReport", "PoolOffer", "load_catalog", "offers_to_pools", "parse_catalog"]

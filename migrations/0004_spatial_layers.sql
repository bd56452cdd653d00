-- Geometry layers: points (lon/lat) and polygons (WKB, with GeoJSON-style properties). PostgreSQL is their
-- system of record; the engines keep them resident as GeoArrow-style buffers.
CREATE TABLE IF NOT EXISTS spatial_layers (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    kind        text NOT NULL CHECK (kind IN ('points', 'polygons')),
    count       bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS spatial_points (
    layer_id  bigint NOT NULL REFERENCES spatial_layers (id) ON DELETE CASCADE,
    position  bigint NOT NULL,  -- row in the layer, the order engines use
    id        bigint NOT NULL,
    lon       double precision NOT NULL,
    lat       double precision NOT NULL,
    PRIMARY KEY (layer_id, position)
);

CREATE TABLE IF NOT EXISTS spatial_polygons (
    layer_id   bigint NOT NULL REFERENCES spatial_layers (id) ON DELETE CASCADE,
    position   bigint NOT NULL,
    id         bigint NOT NULL,
    wkb        bytea NOT NULL,
    properties jsonb,
    PRIMARY KEY (layer_id, position)
);

-- Monthly partitions are made and dropped through these functions, which run with the rights
-- of the role that applied the migrations (the shard's owner role), so that the role nodes
-- connect as at run time needs no right to create or drop tables: it may write and read the
-- shard's rows, raise the fence, and make or drop a month of the four partitioned tables,
-- nothing else (ARCHITECTURE.md, "Trust inside the cluster").

-- The partition of `parent` for the month starting `first_day` (`messages_p202612`), where
-- `parent` is one of the four partitioned tables and `first_day` the first day of a month.
CREATE FUNCTION ste_partition_name(parent TEXT, first_day DATE) RETURNS TEXT
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
    IF parent NOT IN ('messages', 'trades', 'cls_outbox', 'exceptions') THEN
        RAISE EXCEPTION 'not a partitioned table of a shard: %', parent;
    END IF;
    IF first_day IS NULL OR first_day <> date_trunc('month', first_day)::date THEN
        RAISE EXCEPTION 'a partition starts on the first day of a month, not %', first_day;
    END IF;
    RETURN parent || '_p' || to_char(first_day, 'YYYYMM');
END;
$$;

CREATE FUNCTION ste_create_partition(parent TEXT, first_day DATE) RETURNS VOID
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
        ste_partition_name(parent, first_day),
        parent,
        first_day,
        (first_day + interval '1 month')::date
    );
END;
$$;

CREATE FUNCTION ste_drop_partition(parent TEXT, first_day DATE) RETURNS VOID
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    EXECUTE format('DROP TABLE IF EXISTS %I', ste_partition_name(parent, first_day));
END;
$$;

-- Functions are callable by every role unless told otherwise: these only by whom the shard's
-- setup grants them to.
REVOKE EXECUTE ON FUNCTION ste_partition_name(TEXT, DATE) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION ste_create_partition(TEXT, DATE) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION ste_drop_partition(TEXT, DATE) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION ste_raise_fence(BIGINT) FROM PUBLIC;

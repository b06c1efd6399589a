-- Fencing (cluster mode): the shard's owner holds a lease whose token grows with every new
-- owner, and every commit of an owner raises the shard's fence to its token first. A commit
-- with a token older than the fence is refused here, in the transaction, so an owner that
-- stalled past its lease cannot write after another node took the shard over. The row lock on
-- the fence orders concurrent owners' commits.
CREATE TABLE shard_fence (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    token BIGINT NOT NULL
);

CREATE FUNCTION ste_raise_fence(candidate BIGINT) RETURNS VOID AS $$
BEGIN
    INSERT INTO shard_fence (id, token) VALUES (1, candidate)
    ON CONFLICT (id) DO UPDATE SET token = excluded.token
    WHERE shard_fence.token <= excluded.token;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'fenced: this shard has an owner with a newer lease than token %', candidate
            USING ERRCODE = 'SF001';
    END IF;
END;
$$ LANGUAGE plpgsql;

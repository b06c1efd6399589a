-- The roles of one shard's PostgreSQL server, made or brought up to date by its superuser
-- (deploy/local-cluster.sh up; the shard containers' first start under docker compose), before
-- `driver migrate` applies the schema as ste_owner:
--
--   ste_owner        owns the shard's database and schema and applies its migrations; it
--                    makes and drops monthly partitions through functions that run with its
--                    rights (migration 0005), and may make databases (a node sweep's fresh
--                    shards). Not a superuser, cannot make roles.
--   ste_shard_<k>    shard k's role at run time, what every node connects as: reads and writes
--                    the shard's rows, raises the fence, makes and drops a month's partitions
--                    through those functions; no other right (no tables made, no roles, no
--                    other database).
--
-- psql variables (given with \set before this file, on psql's standard input, so that no
-- password is on a command line): db, shard_role, shard_password, owner_password.
\set ON_ERROR_STOP on

SELECT 'CREATE ROLE ste_owner LOGIN NOSUPERUSER CREATEDB NOCREATEROLE'
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ste_owner') \gexec
SELECT format('ALTER ROLE ste_owner LOGIN NOSUPERUSER CREATEDB NOCREATEROLE PASSWORD %L', :'owner_password') \gexec
SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE', :'shard_role')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'shard_role') \gexec
SELECT format('ALTER ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'shard_role', :'shard_password') \gexec

SELECT format('CREATE DATABASE %I OWNER ste_owner', :'db')
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'db') \gexec
SELECT format('ALTER DATABASE %I OWNER TO ste_owner', :'db') \gexec
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', :'db') \gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', :'db', :'shard_role') \gexec

\connect :db
ALTER SCHEMA public OWNER TO ste_owner;
REVOKE ALL ON SCHEMA public FROM PUBLIC;
SELECT format('GRANT USAGE ON SCHEMA public TO %I', :'shard_role') \gexec
-- What ste_owner makes from now on (the migrations, the partitions) and what it made before.
ALTER DEFAULT PRIVILEGES FOR ROLE ste_owner REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
SELECT format('ALTER DEFAULT PRIVILEGES FOR ROLE ste_owner IN SCHEMA public GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I', :'shard_role') \gexec
SELECT format('ALTER DEFAULT PRIVILEGES FOR ROLE ste_owner IN SCHEMA public GRANT USAGE, SELECT ON SEQUENCES TO %I', :'shard_role') \gexec
SELECT format('ALTER DEFAULT PRIVILEGES FOR ROLE ste_owner IN SCHEMA public GRANT EXECUTE ON FUNCTIONS TO %I', :'shard_role') \gexec
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO %I', :'shard_role') \gexec
SELECT format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO %I', :'shard_role') \gexec
SELECT format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO %I', :'shard_role') \gexec

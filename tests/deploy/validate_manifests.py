#!/usr/bin/env python3
"""Validates Kubernetes manifests: the MPIJobs and other objects of deploy/k8s/.

Every YAML document is checked, strictly (an unknown field is an error, as with
`kubectl apply --validate=strict`):
  - a kubeflow.org/v2beta1 MPIJob against the MPIJob CRD's openAPIV3Schema
    (schemas/mpijob-v2beta1.json, vendored from kubeflow/mpi-operator; see schemas/README.md),
    its metadata against the Kubernetes ObjectMeta schema, each replica's pod template against
    the Kubernetes PodTemplateSpec schema (both from kubernetes-validate), and against the
    rules the operator itself enforces (pkg/apis/kubeflow/validation/validation.go after the
    defaults of pkg/apis/kubeflow/v2beta1/default.go);
  - any other object with kubernetes_validate.validate(..., strict=True).
With --project, an MPIJob must also launch train_gpt consistently: mpirun's -np is the
workers' processes (Worker replicas x slotsPerWorker), --map-by (when given) is
ppr:<slotsPerWorker>:node, --hybrid_shard (when given) is the ranks of one worker
(slotsPerWorker x --ranks_per_process, which is 1 unless given), the launcher sets
FSDP_COMM_TIMEOUT_S, and every variable the launcher sets (but OMPI_*, which mpirun reads
itself) is passed on to the ranks with -x; --backend pjrt names its plugin (--pjrt_plugin, or
FSDP_PJRT_PLUGIN passed with -x).

Usage: validate_manifests.py [--k8s-version 1.31] [--project] [--expect-invalid] FILE...
Exit code 0 when every file is as expected (valid, or with --expect-invalid each file
rejected, for the reason its '# expect: TEXT' lines give when it has them), 1 otherwise.
"""

import argparse
import copy
import json
import os
import re
import sys

import importlib_resources
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import referencing
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
MPIJOB_SCHEMA = os.path.join(HERE, "schemas", "mpijob-v2beta1.json")
DEFS_ID = "https://kubernetes.io/api/_definitions.json"


def strict_openapi(schema):
    """An OpenAPI v3 CRD schema as JSON Schema with unknown fields rejected.

    The API server prunes (or, with strict field validation, rejects) fields a structural
    schema does not name, unless x-kubernetes-preserve-unknown-fields is set; JSON Schema
    accepts them unless additionalProperties is false.
    """
    if isinstance(schema, list):
        return [strict_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_openapi(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


class Kubernetes:
    """The strict Kubernetes JSON schemas kubernetes-validate ships, for one version."""

    def __init__(self, version):
        versions = [v for v in kv_utils.all_versions()
                    if kv_utils.major_minor(v) == kv_utils.major_minor(version)]
        if not versions:
            raise SystemExit("kubernetes-validate %s has no schemas for Kubernetes %s (it has %s)"
                             % (kubernetes_validate.__version__, version,
                                ", ".join(kv_utils.all_versions())))
        self.version = versions[-1]
        root = importlib_resources.files("kubernetes_validate").joinpath(
            "kubernetes-json-schema", "v%s-local-strict" % self.version)
        defs = json.loads(root.joinpath("_definitions.json").read_text())
        self.registry = referencing.Resource.from_contents(defs) @ referencing.Registry()

    def validator(self, definition):
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  "$ref": "%s#/$defs/%s" % (DEFS_ID, definition)}
        return jsonschema.Draft202012Validator(schema, registry=self.registry)


def where(path):
    return ".".join(str(p) for p in path) or "(top level)"


def schema_errors(validator, doc, prefix=""):
    errors = []
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        errors.append("%s: %s" % (where(prefix.split(".") + list(e.absolute_path) if prefix
                                         else list(e.absolute_path)), e.message[:300]))
    return errors


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def operator_errors(job):
    """pkg/apis/kubeflow/validation/validation.go (v0.8.0), after default.go's defaults."""
    errs = []
    spec = job.get("spec") or {}
    specs = spec.get("mpiReplicaSpecs")
    if not isinstance(specs, dict):
        return ["spec.mpiReplicaSpecs: Required value: must have replica specs"]
    for key in specs:
        if key not in ("Launcher", "Worker"):
            errs.append("spec.mpiReplicaSpecs.%s: not a replica type of the operator "
                        "(Launcher or Worker); it would be ignored" % key)
    defaults = {"Launcher": ("OnFailure", 1), "Worker": ("Never", 0)}
    for kind, (restart_default, replicas_default) in defaults.items():
        rs = specs.get(kind)
        path = "spec.mpiReplicaSpecs[%s]" % kind
        if rs is None:
            if kind == "Launcher":
                errs.append("%s: Required value: must have Launcher replica spec" % path)
            continue
        if not isinstance(rs, dict):
            continue  # the schema reports it
        restart = rs.get("restartPolicy") or restart_default
        if restart not in ("Never", "OnFailure"):
            errs.append('%s.restartPolicy: Unsupported value: "%s": supported values: "Never", '
                        '"OnFailure"' % (path, restart))
        replicas = rs.get("replicas", replicas_default)
        if kind == "Launcher" and replicas != 1:
            errs.append("%s.replicas: Invalid value: %s: must be 1" % (path, replicas))
        if kind == "Worker" and isinstance(replicas, int) and replicas <= 0:
            errs.append("%s.replicas: Invalid value: %s: must be greater than or equal to 1"
                        % (path, replicas))
        containers = (((rs.get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            errs.append("%s.template.spec.containers: Required value: must define at least one "
                        "container" % path)
    slots = spec.get("slotsPerWorker", 1)
    if isinstance(slots, int) and slots < 0:
        errs.append("spec.slotsPerWorker: Invalid value: %d: must be greater than or equal to 0"
                    % slots)
    impl = spec.get("mpiImplementation") or "OpenMPI"
    if impl not in ("OpenMPI", "Intel", "MPICH"):
        errs.append('spec.mpiImplementation: Unsupported value: "%s"' % impl)
    policy = spec.get("runPolicy") or {}
    clean = policy.get("cleanPodPolicy") or "None"
    if clean not in ("None", "Running", "All"):
        errs.append('spec.runPolicy.cleanPodPolicy: Unsupported value: "%s"' % clean)
    for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        v = policy.get(field)
        if isinstance(v, int) and v < 0:
            errs.append("spec.runPolicy.%s: Invalid value: %d: must be greater than or equal to 0"
                        % (field, v))
    worker = specs.get("Worker") if isinstance(specs.get("Worker"), dict) else {}
    n = worker.get("replicas", 1) if worker else 1
    n = n if isinstance(n, int) and n > 0 else 1
    name = (job.get("metadata") or {}).get("name", "")
    host = "%s-worker-%d" % (name, n - 1)
    if len(host) > 63 or not DNS1035.match(host):
        errs.append('metadata.name: Invalid value: "%s": will not able to create pod and service '
                    'with invalid DNS label "%s"' % (name, host))
    return errs


def launcher_command(job):
    rs = job["spec"]["mpiReplicaSpecs"]["Launcher"]
    c = rs["template"]["spec"]["containers"][0]
    return [str(a) for a in (c.get("command") or []) + (c.get("args") or [])], c.get("env") or []


def project_errors(job):
    """train_gpt's launch must match the MPIJob's layout (docs/deploy.md)."""
    errs = []
    spec = job["spec"]
    slots = spec.get("slotsPerWorker", 1)
    workers = spec["mpiReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    cmd, env = launcher_command(job)
    if not cmd or os.path.basename(cmd[0]) != "mpirun":
        return ["the launcher's command is not mpirun: %s" % cmd[:1]]

    def value(flag):
        for i, a in enumerate(cmd):
            if a == flag and i + 1 < len(cmd):
                return cmd[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    np_ = value("-np") or value("-n")
    if np_ is None or not np_.isdigit() or int(np_) != workers * slots:
        errs.append("mpirun -np %s: the workers have %d x slotsPerWorker %d = %d slots"
                    % (np_, workers, slots, workers * slots))
    map_by = value("--map-by")
    if map_by is not None and map_by != "ppr:%d:node" % slots:
        errs.append("mpirun --map-by %s: a worker holds slotsPerWorker = %d processes "
                    "(ppr:%d:node)" % (map_by, slots, slots))
    # Each process plays --ranks_per_process ranks as threads (train_gpt under mpirun).
    per_process = value("--ranks_per_process")
    threads = 1
    if per_process is not None:
        if per_process.isdigit() and int(per_process) >= 1:
            threads = int(per_process)
        else:
            errs.append("--ranks_per_process %s: allowed: 1 or more" % per_process)
    hybrid = value("--hybrid_shard")
    if hybrid is not None and (not hybrid.isdigit() or int(hybrid) != slots * threads):
        errs.append("--hybrid_shard %s: a shard group must be one worker, slotsPerWorker %d x "
                    "--ranks_per_process %d = %d ranks" % (hybrid, slots, threads, slots * threads))
    # -x NAME passes the launcher's NAME; -x NAME=VALUE sets it.
    passed = {cmd[i + 1].split("=", 1)[0] for i, a in enumerate(cmd[:-1]) if a == "-x"}
    if not any(e.get("name") == "FSDP_COMM_TIMEOUT_S" for e in env):
        errs.append("the launcher does not set FSDP_COMM_TIMEOUT_S")
    if "FSDP_COMM_TIMEOUT_S" not in passed:
        errs.append("mpirun does not pass FSDP_COMM_TIMEOUT_S on to the ranks (-x)")
    for e in env:
        name = e.get("name", "")
        if name != "FSDP_COMM_TIMEOUT_S" and not name.startswith("OMPI_") and name not in passed:
            errs.append("the launcher sets %s but mpirun does not pass it on to the ranks "
                        "(-x %s): ssh starts them, the workers' environment does not reach them"
                        % (name, name))
    if value("--backend") == "pjrt" and value("--pjrt_plugin") is None and (
            "FSDP_PJRT_PLUGIN" not in passed):
        errs.append("--backend pjrt names no plugin: give --pjrt_plugin, or set FSDP_PJRT_PLUGIN "
                    "in the launcher and pass it with -x")
    if not any("train_gpt" in a for a in cmd):
        errs.append("the launcher does not run train_gpt")
    return errs


def check_document(doc, k8s, mpijob, templates, meta, project):
    """Returns (what was checked, errors)."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return "?", ["not a Kubernetes object (no kind or apiVersion)"]
    name = "%s/%s" % (doc["kind"], (doc.get("metadata") or {}).get("name", "?"))
    if doc["apiVersion"] == "kubeflow.org/v2beta1" and doc["kind"] == "MPIJob":
        errors = schema_errors(mpijob, doc)
        errors += schema_errors(meta, doc.get("metadata") or {}, "metadata")
        specs = ((doc.get("spec") or {}).get("mpiReplicaSpecs")) or {}
        if isinstance(specs, dict):
            for kind, rs in specs.items():
                if isinstance(rs, dict) and "template" in rs:
                    errors += schema_errors(templates, rs["template"],
                                            "spec.mpiReplicaSpecs.%s.template" % kind)
        errors += operator_errors(doc)
        if project and not errors:
            errors += project_errors(doc)
        return name, errors
    try:
        kubernetes_validate.validate(doc, k8s.version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return name, ["%s: %s" % (where(list(e.path)), e.message[:300])]
    except kv_utils.SchemaNotFoundError as e:
        return name, [e.message]
    return name, []


def expected_errors(path):
    """The '# expect: TEXT' lines of a wrong-on-purpose manifest: each TEXT must be part of an
    error, so that the file is rejected for the reason it was written for."""
    with open(path) as f:
        return [line.split(":", 1)[1].strip() for line in f if line.startswith("# expect:")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k8s-version", default=os.environ.get("FSDP_K8S_VERSION", "1.31"))
    parser.add_argument("--project", action="store_true")
    parser.add_argument("--expect-invalid", action="store_true")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()

    k8s = Kubernetes(args.k8s_version)
    with open(MPIJOB_SCHEMA) as f:
        mpijob_schema = strict_openapi(json.load(f))
    # The CRD gives metadata as a bare object; ObjectMeta is checked on its own.
    mpijob_schema = copy.deepcopy(mpijob_schema)
    mpijob_schema["properties"]["metadata"] = {"type": "object"}
    mpijob = jsonschema.Draft202012Validator(mpijob_schema)
    templates = k8s.validator("io.k8s.api.core.v1.PodTemplateSpec")
    meta = k8s.validator("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")

    failed = False
    for path in args.files:
        try:
            with open(path) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except (OSError, yaml.YAMLError) as e:
            docs, load_error = [], str(e).replace("\n", " ")
        else:
            load_error = None if docs else "no YAML document"
        results = [("?", [load_error])] if load_error else [
            check_document(d, k8s, mpijob, templates, meta, args.project) for d in docs]
        rejected = any(errors for _, errors in results)
        expected = expected_errors(path) if args.expect_invalid else []
        for name, errors in results:
            if args.expect_invalid:
                if errors:
                    print("rejected  %s %s: %s" % (path, name, errors[0]))
                missing = [e for e in expected if not any(e in x for x in errors)]
                if errors and missing:
                    print("WRONG     %s: rejected, but not for the reason its '# expect:' line "
                          "gives (%s); the errors: %s" % (path, "; ".join(missing), errors))
                    failed = True
            elif errors:
                for e in errors:
                    print("INVALID   %s %s: %s" % (path, name, e))
            else:
                print("valid     %s %s (Kubernetes %s)" % (path, name, k8s.version))
        if args.expect_invalid and not rejected:
            print("ACCEPTED  %s: this manifest is wrong on purpose but passed validation" % path)
            failed = True
        if not args.expect_invalid and rejected:
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

// A small ragline client for Node.js: loads the same .proto files as every other client,
// sets identity metadata and a deadline on every call, and reads the google.rpc error
// details (BadRequest, ErrorInfo, RetryInfo) that ragline sends with every error.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const PROTO_ROOT = process.env.RAGLINE_PROTO_DIR || path.resolve(__dirname, '../../proto');
const GOOGLE_ROOT = path.dirname(require.resolve('google-proto-files/package.json'));
const SERVICES = ['orchestrator', 'retrieval', 'embedding', 'rerank', 'generation', 'budget'];

function loadRagline() {
  const definition = protoLoader.loadSync(
    SERVICES.map((name) => `ragline/v1/${name}.proto`),
    // keepCase: field names exactly as in the .proto files (snake_case), like grpcurl.
    { includeDirs: [PROTO_ROOT, GOOGLE_ROOT], keepCase: true, longs: String, enums: String,
      defaults: true, oneofs: true },
  );
  return grpc.loadPackageDefinition(definition).ragline.v1;
}

let errorTypes = null;
function loadErrorTypes() {
  if (errorTypes === null) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(GOOGLE_ROOT, target);
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
    errorTypes = root;
  }
  return errorTypes;
}

// Identity: a token when authentication is on, otherwise tenant / principal / scopes.
function metadataFor({ token, tenant, principal, scopes, runId } = {}) {
  const metadata = new grpc.Metadata();
  if (token) {
    metadata.set('authorization', `Bearer ${token}`);
  } else {
    metadata.set('x-ragline-tenant', tenant || 'default');
    if (principal) metadata.set('x-ragline-principal', principal);
    if (scopes && scopes.length) metadata.set('x-ragline-scopes', scopes.join(','));
  }
  if (runId) metadata.set('x-ragline-run-id', runId);
  return metadata;
}

// The rich details of a failed call: what a program branches on (never the message text).
function errorDetails(error) {
  const out = { code: grpc.status[error.code] || String(error.code), message: error.details };
  const raw = error.metadata && error.metadata.get('grpc-status-details-bin');
  if (!raw || raw.length === 0) return out;
  const root = loadErrorTypes();
  const status = root.lookupType('google.rpc.Status').decode(raw[0]);
  for (const detail of status.details) {
    const name = (detail.type_url || detail.typeUrl).split('/').pop();
    let type;
    try {
      type = root.lookupType(name);
    } catch (_unknown) {
      continue;
    }
    const value = type.toObject(type.decode(detail.value), { longs: Number });
    if (name === 'google.rpc.ErrorInfo') {
      out.reason = value.reason;
      out.domain = value.domain;
      out.metadata = value.metadata || {};
    } else if (name === 'google.rpc.BadRequest') {
      out.fieldViolations = (value.fieldViolations || []).map((v) => ({
        field: v.field, description: v.description,
      }));
    } else if (name === 'google.rpc.RetryInfo') {
      const delay = value.retryDelay || {};
      out.retryDelayMs = Number(delay.seconds || 0) * 1000 + Math.round((delay.nanos || 0) / 1e6);
    }
  }
  return out;
}

// Whether a retry can cure `error` and after how long (ms), following ragline's rule:
// UNAVAILABLE always; RESOURCE_EXHAUSTED and ABORTED only when the server said when.
function retryDelayMs(details) {
  if (details.code === 'UNAVAILABLE') return details.retryDelayMs ?? 100;
  if (['RESOURCE_EXHAUSTED', 'ABORTED'].includes(details.code)) return details.retryDelayMs ?? null;
  return null;
}

function orchestrator(address, credentials = grpc.credentials.createInsecure()) {
  const v1 = loadRagline();
  return new v1.OrchestratorService(address, credentials);
}

module.exports = { loadRagline, metadataFor, errorDetails, retryDelayMs, orchestrator, grpc };
